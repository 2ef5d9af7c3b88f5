"""`tandem decode` / `tandem colocated`: a worker that decodes (pulling KV from prefill workers,
or prefilling locally), or one that does both phases with no disaggregation."""

from __future__ import annotations


def main(argv: list[str], role: str = "decode") -> int:
    from tandem.engine.worker_cli import main as worker_main

    return worker_main(role, argv)

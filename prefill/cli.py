"""`tandem prefill`: a worker that runs chunked prefill and hands the KV to decode workers."""

from __future__ import annotations


def main(argv: list[str]) -> int:
    from tandem.engine.worker_cli import main as worker_main

    return worker_main("prefill", argv)

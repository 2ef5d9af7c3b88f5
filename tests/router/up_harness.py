"""Runs ``tandem.up.launch`` with the real router and WorkerDouble processes (the tests' stand-in
for real workers), as ``tandem up`` would; ``--fail-worker`` adds a worker that dies at start-up."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tandem.child_command import tandem_argv
from tandem.engine.cluster_token import CLUSTER_TOKEN_ENV, generate_token
from tandem.up import ProcessSpec, free_port, launch

HERE = Path(__file__).parent


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--log-dir", required=True)
    p.add_argument("--fail-worker", action="store_true")
    a = p.parse_args()
    router_url = f"http://127.0.0.1:{a.port}"
    internal = free_port()
    internal_url = f"http://127.0.0.1:{internal}"
    env = ((CLUSTER_TOKEN_ENV, generate_token()),)  # as `tandem up` does: one per run
    router = ProcessSpec(
        "router", "router",
        (*tandem_argv("router"), "--model", "test-model", "--tokenizer",
         a.tokenizer, "--host", "127.0.0.1", "--port", str(a.port), "--internal-port",
         str(internal), "--heartbeat-timeout", "2"),
        router_url, env, internal_url,
    )  # fmt: skip
    specs = [router]
    for role in ("prefill", "decode"):
        port = free_port()
        argv = (
            sys.executable,
            str(HERE / "worker_proc.py"),
            "--role",
            role,
            "--port",
            str(port),
            "--router-url",
            internal_url,
            "--tokenizer",
            a.tokenizer,
            "--model",
            "test-model",
        )
        specs.append(ProcessSpec(f"{role}-0", role, argv, f"http://127.0.0.1:{port}", env))
    if a.fail_worker:
        argv = (sys.executable, "-c", "print('boom: cannot load weights'); raise SystemExit(3)")
        specs.append(ProcessSpec("decode-1", "decode", argv, "http://127.0.0.1:1"))
    return launch(specs, Path(a.log_dir), 60.0, lambda: print("READY", flush=True))


if __name__ == "__main__":
    raise SystemExit(main())

"""A WorkerDouble as a process, for the ``tandem up`` tests: registers, heartbeats, serves."""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

from tokenizers import Tokenizer
from worker_double import WorkerDouble

from tandem.engine.cluster_token import ClusterToken


async def amain(args: argparse.Namespace) -> None:
    # The raw tokenizers object decodes like the HF one and avoids importing transformers.
    tok = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    # As a real worker: the cluster token from the environment `tandem up` hands over.
    w = WorkerDouble(
        role=args.role, tokenizer=tok, model=args.model, token=ClusterToken.require(None)
    )
    await w.start(args.router_url, port=args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print(f"worker {w.engine_id} serving at {w.served.url}", flush=True)
    await stop.wait()
    await w.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for flag in ("--role", "--router-url", "--tokenizer", "--model"):
        p.add_argument(flag, required=True)
    p.add_argument("--port", type=int, required=True)
    asyncio.run(amain(p.parse_args()))

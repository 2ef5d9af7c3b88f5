"""Measure KV transfer time against bytes for one transport (the transfer half of a profile).

Called by ``tandem profile``. A child process (this module with ``--serve``) runs a real
prefill-role connector over a KV cache of the profiled layout and publishes requests on demand;
this process runs a decode-role connector and pulls them, as a decode worker does: the time is
``start_load`` to its ``LoadResult`` (PULL, the data, PULL_DONE where the transport needs it).
The first pull of a pair also handshakes and is not counted. Two processes, as in serving, so a
transport's copies and threads do not share one interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from tandem.child_command import module_argv
from tandem.engine.kv_connector import KVTransferParams
from tandem.engine.kv_layout import DTYPES, KVLayout
from tandem.engine.sim.profile import TransferPoint


def _serve(transport: str, layout: KVLayout) -> None:
    """Child: read a block count per line, publish that many blocks, print the params."""
    import torch

    from tandem.kvtransfer.factory import create_connector

    kv = torch.randn(layout.shape).to(DTYPES[layout.dtype])
    conn = create_connector(transport, layout, kv, "prefill", lease_seconds=120)
    print(json.dumps({"ready": True}), flush=True)
    for i, line in enumerate(sys.stdin):
        n = int(line)
        params = conn.publish(f"p{i}", list(range(n)), n * layout.block_size, 1)
        print(json.dumps(params.to_dict()), flush=True)
        conn.take_released()
    conn.close()


def measure_transfers(
    transport: str,
    layout: KVLayout,
    block_counts: Sequence[int],
    repeats: int = 5,
    progress: Callable[[], None] = lambda: None,
    timeout_s: float = 120.0,
) -> list[TransferPoint]:
    """One point per block count: the lower quartile of ``repeats`` pulls of that many blocks."""
    import torch

    from tandem.kvtransfer.factory import create_connector

    layout = layout.with_num_blocks(max(block_counts) + 1)
    child = subprocess.Popen(
        module_argv("tandem.kvtransfer.transfer_profile", transport, json.dumps(layout.to_wire())),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    conn = None
    try:
        if not json.loads(child.stdout.readline() or "{}").get("ready"):
            raise RuntimeError(f"the {transport} prefill side did not start")
        kv = torch.zeros(layout.shape, dtype=DTYPES[layout.dtype])
        conn = create_connector(transport, layout, kv, "decode", transfer_timeout=timeout_s)
        ids = iter(range(1 << 30))

        def pull(n: int) -> float:
            child.stdin.write(f"{n}\n")
            child.stdin.flush()
            params = KVTransferParams.from_dict(json.loads(child.stdout.readline()))
            t0 = time.perf_counter()
            rid = f"d{next(ids)}"
            conn.start_load(rid, params, list(params.block_ids), list(range(n)))
            deadline = t0 + timeout_s
            while True:
                done = conn.take_finished_loads()
                if done:
                    if not done[0].ok:
                        raise RuntimeError(f"{transport} pull failed: {done[0]}")
                    return time.perf_counter() - t0
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"{transport} pull of {n} blocks timed out")
                time.sleep(0.0001)

        pull(1)  # handshake and data channel set-up
        points = []
        for n in block_counts:
            samples = [pull(n) for _ in range(repeats)]
            low = sorted(samples)[(len(samples) - 1) // 4]  # as the step points: see profiler.py
            points.append(TransferPoint(transport, n * layout.block_bytes, low, tuple(samples)))
            progress()
        return points
    finally:
        if conn is not None:
            conn.close()
        child.stdin.close()
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


if __name__ == "__main__":
    wire = json.loads(sys.argv[2])
    _serve(sys.argv[1], KVLayout(**wire))

"""A connector in its own process, driven by the two-process tests over stdin/stdout (JSON lines).

prefill <transport> <seed> <block_ids json>: publishes one request per list of block ids, prints
``{"params": [...]}``, then prints ``{"released": [...]}`` as ids are released, until stdin closes.
decode <transport> <layout json>: prints ``{"ready": true}``, reads one KVTransferParams JSON line
from stdin, pulls every block into local blocks 0..n-1, prints ``{"started": true}`` and then the
LoadResult.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from kvt_helpers import SMALL, kv_cache

from tandem.engine.kv_connector import KVTransferParams
from tandem.engine.kv_layout import KVLayout
from tandem.kvtransfer import create_connector


def _emit(obj: object) -> None:
    print(json.dumps(obj), flush=True)


def run_prefill(transport: str, seed: int, requests: list[list[int]]) -> None:
    conn = create_connector(transport, SMALL, kv_cache(SMALL, seed), "prefill", lease_seconds=5)
    params = [
        conn.publish(f"req{i}", ids, 16 * len(ids), 1).to_dict() for i, ids in enumerate(requests)
    ]
    _emit({"params": params})
    stdin_closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stdin_closed.set()), daemon=True).start()
    while not stdin_closed.is_set():
        released = conn.take_released()
        if released:
            _emit({"released": released})
        stdin_closed.wait(0.01)
    conn.close()


def run_decode(transport: str, layout_json: str) -> None:
    layout = KVLayout(**json.loads(layout_json))
    conn = create_connector(transport, layout, kv_cache(layout, None), "decode")
    _emit({"ready": True})
    params = KVTransferParams.from_dict(json.loads(sys.stdin.readline()))
    n = len(params.block_ids)
    conn.start_load("d", params, list(params.block_ids), list(range(n)))
    _emit({"started": True})
    while True:
        for r in conn.take_finished_loads():
            _emit({"ok": r.ok, "reason": r.reason})
        time.sleep(0.01)


if __name__ == "__main__":
    if sys.argv[1] == "prefill":
        run_prefill(sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))
    else:
        run_decode(sys.argv[2], sys.argv[3])

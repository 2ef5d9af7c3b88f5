"""KV transfer throughput between two processes: ucx and tcp connectors vs raw loopback.

For each (transport, UCX_TLS) setting a fresh decode process pulls whole prompts' KV blocks from a
fresh prefill process, so UCX environment settings apply to both ends. The baseline is a plain
TCP socket moving the same bytes between two processes (sendall / recv_into, preallocated).

    python benchmarks/kv_transfer.py                      # demo + large layouts, ~2 minutes
    python benchmarks/kv_transfer.py --quick              # smaller sweep
    python benchmarks/kv_transfer.py --ucx-tls "tcp;tcp,sm;tcp UCX_TCP_TX_SEG_SIZE=512k"

Latency is start_load -> LoadResult on decode (side-channel PULL, data, PULL_DONE), median of
``--reps`` after one warm-up that also does the handshake. GB/s = KV bytes / median latency.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

LAYOUTS = {
    # the demo model: 4 layers, 2 KV heads, head_dim 64, block 16, float32 -> 64 KiB per block
    "demo": dict(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32"),
    # a Llama-3-8B-like cache: 32 layers, 8 KV heads, head_dim 128, fp16 -> 2 MiB per block
    "large": dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16"),
}
TOKENS = {"demo": [256, 1024, 4096, 8192], "large": [256, 1024, 2048]}
QUICK_TOKENS = {"demo": [256, 2048], "large": [256, 1024]}


@dataclass(frozen=True, slots=True)
class Row:
    layout: str
    tokens: int
    nbytes: int
    transport: str
    tls: str
    median_s: float
    raw_s: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.median_s / 1e9

    @property
    def raw_gbps(self) -> float:
        return self.nbytes / self.raw_s / 1e9


def _layout(name: str, tokens_max: int):  # noqa: ANN202
    from tandem.engine.kv_layout import KVLayout

    return KVLayout(num_blocks=tokens_max // 16 + 1, **LAYOUTS[name])


def _emit(obj: object) -> None:
    print(json.dumps(obj), flush=True)


# ----- child: prefill server ------------------------------------------------------------------


def serve_prefill(transport: str, layout_name: str, tokens_max: int) -> None:
    """Publishes requests on demand: stdin ``<n_blocks>`` -> stdout params JSON."""
    import torch

    from tandem.engine.kv_layout import DTYPES
    from tandem.kvtransfer import create_connector

    layout = _layout(layout_name, tokens_max)
    kv = torch.randn(layout.shape).to(DTYPES[layout.dtype])
    conn = create_connector(transport, layout, kv, "prefill", lease_seconds=60)
    _emit({"ready": True})
    for i, line in enumerate(sys.stdin):
        n = int(line)
        params = conn.publish(f"r{i}", list(range(n)), n * layout.block_size, 1)
        _emit(params.to_dict())
        conn.take_released()
    conn.close()


# ----- child: decode client, runs one (transport, tls) setting --------------------------------


def run_decode(transport: str, layout_name: str, tokens: list[int], reps: int) -> None:
    import torch

    from tandem.engine.kv_layout import DTYPES
    from tandem.kvtransfer import KVTransferParams, create_connector

    layout = _layout(layout_name, max(tokens))
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", transport, layout_name, str(max(tokens))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdin is not None and server.stdout is not None
    json.loads(server.stdout.readline())
    kv = torch.zeros(layout.shape, dtype=DTYPES[layout.dtype])
    conn = create_connector(transport, layout, kv, "decode", transfer_timeout=120)

    def pull(n_blocks: int) -> float:
        server.stdin.write(f"{n_blocks}\n")
        server.stdin.flush()
        params = KVTransferParams.from_dict(json.loads(server.stdout.readline()))
        t0 = time.perf_counter()
        conn.start_load("d", params, list(params.block_ids), list(range(n_blocks)))
        while True:
            done = conn.take_finished_loads()
            if done:
                break
            time.sleep(0.0002)
        dt = time.perf_counter() - t0
        if not done[0].ok:
            raise RuntimeError(f"load failed: {done[0]}")
        return dt

    raw = RawLoopback()
    pull(1)  # handshake and connection setup
    for t in tokens:
        n = t // layout.block_size
        nbytes = n * layout.block_bytes
        pull(n)  # warm-up at this size
        raw.move(nbytes)
        times, raw_times = [], []
        for _ in range(reps):  # interleaved, so both see the same machine load
            times.append(pull(n))
            raw_times.append(raw.move(nbytes))
        _emit(
            {
                "tokens": t,
                "nbytes": nbytes,
                "median_s": statistics.median(times),
                "raw_s": statistics.median(raw_times),
            }
        )
    raw.close()
    conn.close()
    server.stdin.close()
    server.wait(timeout=30)


# ----- raw loopback baseline ------------------------------------------------------------------


def raw_server() -> None:
    """Sends ``n`` bytes per stdin line over one TCP connection from a preallocated buffer."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    _emit({"port": srv.getsockname()[1]})
    conn, _ = srv.accept()
    buf = bytearray(0)
    for line in sys.stdin:
        n = int(line)
        if len(buf) < n:
            buf = bytearray(os.urandom(16)) * (n // 16 + 1)
        conn.sendall(memoryview(buf)[:n])
    conn.close()


class RawLoopback:
    """The baseline: a plain TCP socket from a child process, receiving into one buffer."""

    def __init__(self) -> None:
        self.server = subprocess.Popen(
            [sys.executable, __file__, "--raw-server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.server.stdin is not None and self.server.stdout is not None
        port = json.loads(self.server.stdout.readline())["port"]
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.buf = memoryview(bytearray(0))

    def move(self, n: int) -> float:
        if len(self.buf) < n:
            self.buf = memoryview(bytearray(n))
        assert self.server.stdin is not None
        t0 = time.perf_counter()
        self.server.stdin.write(f"{n}\n")
        self.server.stdin.flush()
        got = 0
        while got < n:
            got += self.sock.recv_into(self.buf[got:n])
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close()
        assert self.server.stdin is not None
        self.server.stdin.close()
        self.server.wait(timeout=30)


# ----- orchestration --------------------------------------------------------------------------


def _run_setting(transport: str, tls: str, layout: str, tokens: list[int], reps: int) -> list[Row]:
    env = dict(os.environ)
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if transport == "ucx":
        # a setting is "UCX_TLS[ KEY=VALUE ...]", e.g. "tcp UCX_TCP_TX_SEG_SIZE=512k"
        tls_value, *extra = tls.split()
        env["UCX_TLS"] = tls_value
        env.update(kv.split("=", 1) for kv in extra)
    cmd = [sys.executable, __file__, "--decode", transport, layout, json.dumps(tokens), str(reps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        print(f"# {transport} {tls} {layout} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return []
    rows = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            rows.append(
                Row(layout, r["tokens"], r["nbytes"], transport, tls, r["median_s"], r["raw_s"])
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layouts", default="demo,large")
    ap.add_argument(
        "--ucx-tls",
        default="tcp;tcp,sm",
        help='semicolon-separated UCX settings, each "UCX_TLS[ KEY=VALUE ...]"',
    )
    args = ap.parse_args()
    table = QUICK_TOKENS if args.quick else TOKENS
    settings = [("ucx", tls) for tls in args.ucx_tls.split(";")] + [("tcp", "-")]
    rows: list[Row] = []
    for layout in args.layouts.split(","):
        for transport, tls in settings:
            rows += _run_setting(transport, tls, layout, table[layout], args.reps)
    print(
        f"# machine: {platform.node()} {platform.machine()} {os.cpu_count()} CPUs, "
        f"python {platform.python_version()}, reps {args.reps}; raw = plain TCP socket between "
        "two processes, same bytes, measured interleaved with each transfer"
    )
    print("| layout | tokens | MiB | transport | UCX env | latency ms | GB/s | raw GB/s | % raw |")
    print("| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for r in sorted(rows, key=lambda r: (r.layout, r.tokens, r.transport, r.tls)):
        print(
            f"| {r.layout} | {r.tokens} | {r.nbytes / 2**20:.1f} | {r.transport} | {r.tls} | "
            f"{r.median_s * 1e3:.2f} | {r.gbps:.2f} | {r.raw_gbps:.2f} | "
            f"{100 * r.gbps / r.raw_gbps:.0f}% |"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve_prefill(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--decode":
        run_decode(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--raw-server":
        raw_server()
    else:
        main()

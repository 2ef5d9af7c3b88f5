"""`tandem up --routers 2`: every worker registers with both routers, both answer correctly, a
restarted router learns every worker again, and a killed worker is dropped by both."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
from procs import AUTH, Proc, free_port, wait_for

from tandem.engine.demo import expected_answer, make_user_message


def workers(internal: str) -> list[dict]:
    try:
        r = httpx.get(f"{internal}/internal/workers", headers=AUTH, timeout=2)
        return r.json()["workers"] if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        return []


def ask(url: str, word: str) -> str:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "demo", "messages": [{"role": "user", "content": make_user_message(word)}],
              "temperature": 0, "max_tokens": 16},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def router_pid(port: int) -> int:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"router" in argv and str(port).encode() in argv and b"--port" in argv:
            return int(entry)
    raise AssertionError(f"no router on {port}")


def test_two_routers_share_every_worker(tmp_path: Path) -> None:
    base = free_port()
    while not all(_free(base + i) for i in range(2)):
        base = free_port()
    internal = free_port()
    while not all(_free(internal + i) for i in range(2)) or internal in (base, base + 1):
        internal = free_port()
    urls = [f"http://127.0.0.1:{base + i}" for i in range(2)]
    registries = [f"http://127.0.0.1:{internal + i}" for i in range(2)]
    up = Proc(["up", "--routers", "2", "--port", str(base), "--internal-port", str(internal),
               "--prefill", "1", "--decode", "2", "--kv-transport", "tcp", "--log-dir",
               str(tmp_path)], tmp_path, "up")  # fmt: skip
    replacement: Proc | None = None
    try:

        def everyone_everywhere() -> bool:
            if not up.alive():
                raise RuntimeError(up.log_tail())
            return all(len(workers(r)) == 3 for r in registries)

        wait_for(everyone_everywhere, 240, "3 workers on both routers", interval=0.5)
        ids = [sorted(w["engine_id"] for w in workers(r)) for r in registries]
        assert ids[0] == ids[1]
        for i, url in enumerate(urls):
            word = f"both{i}"
            assert ask(url, word) == expected_answer(word)
        # Router 1 dies and a new one takes its ports: the workers register with it again.
        os.kill(router_pid(base + 1), signal.SIGKILL)
        again = ["router", "--host", "127.0.0.1", "--port", str(base + 1), "--internal-port",
                 str(internal + 1)]  # fmt: skip
        replacement = Proc(again, tmp_path, "router-1-again")
        wait_for(lambda: len(workers(registries[1])) == 3, 60, "the restarted router re-learns")
        assert sorted(w["engine_id"] for w in workers(registries[1])) == ids[0]
        assert ask(urls[1], "again7") == expected_answer("again7")
        assert ask(urls[0], "still8") == expected_answer("still8")
        # A decode worker killed: both routers drop it, both keep answering.
        decode_port = next(w["url"] for w in workers(registries[0]) if w["role"] == "decode")
        os.kill(_listener_pid(int(decode_port.rsplit(":", 1)[1])), signal.SIGKILL)
        wait_for(lambda: all(len(workers(r)) == 2 for r in registries), 30, "dropped by both")
        for i, url in enumerate(urls):
            assert ask(url, f"after{i}") == expected_answer(f"after{i}")
    finally:
        if replacement is not None:
            replacement.stop()
        up.stop(signal.SIGINT)


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _listener_pid(port: int) -> int:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"tandem.cli" in argv and b"decode" in argv and str(port).encode() in argv:
            return int(entry)
    raise AssertionError(f"no decode worker on {port}")

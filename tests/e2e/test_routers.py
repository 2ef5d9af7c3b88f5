"""`tandem up --routers 2`: every worker registers with both routers, both answer correctly, a
router killed and restarted by `tandem up` learns every worker again, and a killed worker is
dropped by both.

The routers' ports lie below the kernel's ephemeral range: a port from that range, free once its
router dies, can be taken as the source port of any outgoing connection on the host before the
restarted router binds it again."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
from procs import AUTH, Proc, up_is_ready, wait_for

from tandem.child_command import subcommand
from tandem.engine.demo import expected_answer, make_user_message
from tandem.up_config import _ephemeral_range, port_is_free, worker_port


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


def tandem_pid(command: str, port: int) -> int | None:
    """The pid of the tandem ``command`` (``router``, ``decode``) serving on ``port``, if any."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode().split("\0")
        except (OSError, UnicodeDecodeError):
            continue
        if subcommand(argv) == command and "--port" in argv and str(port) in argv:
            return int(entry)
    return None


def router_pid(port: int) -> int:
    pid = tandem_pid("router", port)
    assert pid is not None, f"no router on {port}"
    return pid


def test_two_routers_share_every_worker(tmp_path: Path) -> None:
    base, internal = _free_pair(), _free_pair()
    while internal in (base - 1, base, base + 1):
        internal = _free_pair()
    urls = [f"http://127.0.0.1:{base + i}" for i in range(2)]
    registries = [f"http://127.0.0.1:{internal + i}" for i in range(2)]
    up = Proc(["up", "--routers", "2", "--port", str(base), "--internal-port", str(internal),
               "--prefill", "1", "--decode", "2", "--kv-transport", "tcp", "--log-dir",
               str(tmp_path)], tmp_path, "up")  # fmt: skip
    try:

        def everyone_everywhere() -> bool:
            if not up.alive():
                raise RuntimeError(up.log_tail())
            # `tandem up` must have finished its own start-up too: a child that dies before
            # then fails the start-up, and it stops every process (the router killed below).
            return up_is_ready(up.log_path) and all(len(workers(r)) == 3 for r in registries)

        wait_for(everyone_everywhere, 240, "tandem up ready, 3 workers on both", interval=0.5)
        ids = [sorted(w["engine_id"] for w in workers(r)) for r in registries]
        assert ids[0] == ids[1]
        for i, url in enumerate(urls):
            word = f"both{i}"
            assert ask(url, word) == expected_answer(word)
        # Router 1 dies; `tandem up` restarts it on the same ports, and the workers register with
        # the new process (its registry starts empty).
        killed = router_pid(base + 1)
        os.kill(killed, signal.SIGKILL)

        def relearned() -> bool:
            if not up.alive():
                raise RuntimeError(up.log_tail())
            return (
                tandem_pid("router", base + 1) not in (None, killed)
                and len(workers(registries[1])) == 3
            )

        try:
            wait_for(relearned, 60, "the restarted router re-learns", interval=0.5)
        except TimeoutError as exc:
            router_log = (tmp_path / "router-1.log").read_text(errors="replace")
            raise AssertionError(
                f"{exc}\n--- up ---\n{up.log_tail()}\n--- router-1 ---\n{router_log[-4000:]}"
            ) from exc
        assert sorted(w["engine_id"] for w in workers(registries[1])) == ids[0]
        assert ask(urls[1], "again7") == expected_answer("again7")
        assert ask(urls[0], "still8") == expected_answer("still8")
        # A decode worker killed: both routers drop it, both keep answering.
        # (`tandem up` restarts it under a new engine id, so the check is on the id, not a count.)
        victim = next(w for w in workers(registries[0]) if w["role"] == "decode")
        victim_pid = tandem_pid("decode", int(victim["url"].rsplit(":", 1)[1]))
        assert victim_pid is not None, f"no decode worker at {victim['url']}"
        os.kill(victim_pid, signal.SIGKILL)

        def dropped_by_both() -> bool:
            listed = [{w["engine_id"] for w in workers(r)} for r in registries]
            return all(known and victim["engine_id"] not in known for known in listed)

        wait_for(dropped_by_both, 30, "dropped by both")
        for i, url in enumerate(urls):
            assert ask(url, f"after{i}") == expected_answer(f"after{i}")
    finally:
        up.stop(signal.SIGINT)


def _free_pair() -> int:
    """A port p with p and p + 1 free, both below the ephemeral range (see the docstring)."""
    while True:
        p = worker_port()
        if p + 1 < _ephemeral_range()[0] and port_is_free("127.0.0.1", p + 1):
            return p

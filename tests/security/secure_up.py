"""The security suite's one real `tandem up`, and what the attacks need to look at processes.

``SecureUp`` runs `tandem up` (router + 1 prefill + 1 decode, KV over TCP) without a cluster
token in its environment, so it makes one for the run, and learns that token the way a local
administrator could: from the router's /proc environment (never argv, never a log). The /proc
helpers read argv, environments, peak memory and listening sockets of the up's process tree.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import httpx
from procs import Proc, free_port, wait_for

from tandem.child_command import subcommand
from tandem.engine.demo import expected_answer, make_user_message


def children_of(pid: int) -> list[int]:
    """Every descendant of ``pid`` (scans /proc; no psutil here)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _address(hex_addr: str) -> tuple[str, int]:
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # /proc/net/tcp6 stores four little-endian 32-bit words
        words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        ip = socket.inet_ntop(socket.AF_INET6, words)
    return ip, int(port_hex, 16)


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on."""
    inodes = _socket_inodes(pid)
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[9]) in inodes:  # 0A: LISTEN
                out.append(_address(fields[1]))
    return out


class SecureUp:
    """One `tandem up` for the whole security module; stop() ends its process group."""

    def __init__(self, tmp: Path) -> None:
        self.port, self.internal_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.internal_url = f"http://127.0.0.1:{self.internal_port}"
        self.log_dir = tmp
        self.proc = Proc(
            ["up", "--port", str(self.port), "--internal-port", str(self.internal_port),
             "--prefill", "1", "--decode", "1", "--kv-transport", "tcp", "--log-dir", str(tmp)],
            tmp, "up", env={"TANDEM_CLUSTER_TOKEN": None},
        )  # fmt: skip
        self.token = ""
        self.baseline: list[tuple[str, str, str]] = []

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def pids(self) -> dict[str, int]:
        """The up's children by role: router, prefill, decode."""
        out = {}
        for pid in children_of(self.proc.proc.pid):
            try:
                argv = cmdline(pid)
            except OSError:
                continue
            name = subcommand(argv)
            if name is not None:
                out[name] = pid
        return out

    def workers(self) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.internal_url}/internal/workers", headers=self.auth, timeout=5)
        r.raise_for_status()
        return r.json()["workers"]

    def worker_set(self) -> list[tuple[str, str, str]]:
        return sorted((w["engine_id"], w["role"], w["url"]) for w in self.workers())

    def worker_url(self, role: str) -> str:
        (url,) = [w["url"] for w in self.workers() if w["role"] == role]
        return url

    def start(self) -> None:
        def router_up() -> bool:
            if not self.proc.alive():
                raise RuntimeError(self.proc.log_tail())
            return "router" in self.pids()

        wait_for(router_up, 60, "the router process")
        self.token = environ(self.pids()["router"])["TANDEM_CLUSTER_TOKEN"]

        def registered() -> bool:
            if not self.proc.alive():
                raise RuntimeError(self.proc.log_tail())
            try:
                return sorted(w["role"] for w in self.workers()) == ["decode", "prefill"]
            except httpx.HTTPError:
                return False

        wait_for(registered, 180, "both workers registered", interval=0.2)
        self.baseline = self.worker_set()

    def answers_correctly(self, word: str = "safe42") -> bool:
        r = httpx.post(
            f"{self.url}/v1/chat/completions",
            json={"model": "demo", "messages": [{"role": "user",
                  "content": make_user_message(word)}], "temperature": 0, "max_tokens": 16},
            timeout=60,
        )  # fmt: skip
        return r.status_code == 200 and (
            r.json()["choices"][0]["message"]["content"] == expected_answer(word)
        )

    def metric(self, url: str, name: str, **labels: str) -> float:
        total = 0.0
        for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        self.proc.stop()

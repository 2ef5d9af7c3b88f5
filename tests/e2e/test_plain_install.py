"""A plain install serves, and so does the image's filesystem run as its non-root user.

``scripts/plain-install-check`` (a CI step) builds the wheel, installs it with no extras into a
fresh venv (CPU torch first, as the README says) and runs this module with ``TANDEM_PLAIN_VENV``
pointing at that venv; without it the module is skipped (building a venv takes minutes).

1. ``tandem up`` with its defaults, from that venv, answers the demo task (KV over UCX: ucxx is a
   base dependency on Linux x86-64).
2. The Dockerfile's runtime, without Docker: the same venv (root-owned, so read-only to the
   user), ``tandem router``, ``prefill`` and ``decode`` run as UID 10001 in a read-only working
   directory with only their /tmp home writable (HOME=/tmp as in the image,
   PYTHONDONTWRITEBYTECODE=1), the token from a file as a mounted Secret would be, and serve the
   demo task; nothing gets written into the venv.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from procs import free_port, up_is_ready, wait_for

from tandem.engine.demo import expected_answer, make_user_message

VENV = os.environ.get("TANDEM_PLAIN_VENV")
UID = 10001
pytestmark = pytest.mark.skipif(
    not VENV, reason="set TANDEM_PLAIN_VENV (scripts/plain-install-check builds one)"
)


def ask(url: str, word: str) -> str:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "demo", "messages": [{"role": "user", "content": make_user_message(word)}],
              "temperature": 0, "max_tokens": 16},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


class Launched:
    def __init__(self, argv: list[str], log: Path, env: dict[str, str], **kw: object) -> None:
        self.log = log
        with log.open("wb") as f:
            self.proc = subprocess.Popen(
                argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True, **kw
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def clean_env(**extra: str) -> dict[str, str]:
    keep = {"PATH": f"{VENV}/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    return {**keep, "PYTHONUNBUFFERED": "1", **extra}


def test_plain_install_tandem_up_serves_the_demo(tmp_path: Path) -> None:
    port, internal = free_port(), free_port()
    up = Launched([f"{VENV}/bin/tandem", "up", "--port", str(port), "--internal-port",
                   str(internal), "--log-dir", str(tmp_path / "logs")],
                  tmp_path / "up.log", clean_env(HOME=str(tmp_path)), cwd=tmp_path)  # fmt: skip
    try:

        def ready() -> bool:
            if not up.alive():
                raise RuntimeError(up.tail())
            return up_is_ready(up.log)

        wait_for(ready, 300, "a plain-install tandem up", interval=0.5)
        assert "--kv-transport" not in up.log.read_text()  # the defaults, nothing else
        for word in ("plain1", "abc42"):
            assert ask(f"http://127.0.0.1:{port}", word) == expected_answer(word)
    finally:
        up.stop()


@pytest.fixture
def image_root() -> Iterator[Path]:
    """A read-only working directory and a /tmp-like writable home for UID 10001 (outside
    pytest's private temp tree, which that user could not enter)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run as UID 10001")
    root = Path(tempfile.mkdtemp(prefix="tandem-image-"))
    root.chmod(0o755)
    work = root / "work"
    work.mkdir(mode=0o555)
    home = root / "home"
    home.mkdir()
    os.chown(home, UID, UID)
    token = home / "cluster-token"
    token.write_text("image-test-cluster-token-0123456789\n")
    os.chown(token, UID, UID)
    token.chmod(0o440)
    yield root
    work.chmod(0o755)
    shutil.rmtree(root, ignore_errors=True)


def _tree_snapshot(root: Path) -> set[str]:
    return {str(p) for p in root.rglob("*")}


def test_image_filesystem_runs_as_non_root_read_only(image_root: Path) -> None:
    venv_before = _tree_snapshot(Path(VENV))
    home = image_root / "home"
    env = clean_env(HOME=str(home), TMPDIR=str(home), PYTHONDONTWRITEBYTECODE="1",
                    HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # fmt: skip
    as_user = ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups"]
    token = ["--cluster-token-file", str(home / "cluster-token")]
    port, internal = free_port(), free_port()
    registry = f"http://127.0.0.1:{internal}"
    cmds = {
        "router": ["router", "--host", "127.0.0.1", "--port", str(port), "--internal-port",
                   str(internal), *token],
        "prefill": ["prefill", "--port", str(free_port()), "--router-url", registry, *token],
        "decode": ["decode", "--port", str(free_port()), "--router-url", registry, *token],
    }  # fmt: skip
    procs = {}
    try:
        for name, args in cmds.items():
            argv = [*as_user, f"{VENV}/bin/tandem", *args]
            procs[name] = Launched(argv, image_root / f"{name}.log", env, cwd=image_root / "work")
        headers = {"Authorization": "Bearer image-test-cluster-token-0123456789"}

        def registered() -> bool:
            for p in procs.values():
                if not p.alive():
                    raise RuntimeError(p.tail())
            try:
                r = httpx.get(f"{registry}/internal/workers", headers=headers, timeout=2)
            except httpx.HTTPError:
                return False
            return r.status_code == 200 and len(r.json()["workers"]) == 2

        wait_for(registered, 300, "both workers registered", interval=0.5)
        for word in ("image1", "root0"):
            assert ask(f"http://127.0.0.1:{port}", word) == expected_answer(word)
        for p in procs.values():  # setpriv execs the server: the pid is the server's
            status = Path(f"/proc/{p.proc.pid}/status").read_text()
            assert status.split("Uid:")[1].split()[:2] == [str(UID), str(UID)]
    finally:
        for p in procs.values():
            p.stop()
    assert _tree_snapshot(Path(VENV)) == venv_before, "something was written into the image"
    assert not any((image_root / "work").iterdir())

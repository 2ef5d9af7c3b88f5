"""Which KV transport this install can run: UCX (the default) needs ``ucxx``.

``ucxx-cu12`` is a base dependency on Linux x86-64 (the only platform with wheels); elsewhere, or
if it was removed, ``tandem up`` picks TCP and says so, and an explicit ``--kv-transport ucx``
(on ``up`` or a worker) fails with one line that names the fix, before anything loads. Torch-free,
so ``tandem up`` stays quick to start.
"""

from __future__ import annotations

TRANSPORTS = ("ucx", "tcp")


def ucx_problem() -> str | None:
    """Why UCX cannot be used here, in one line; None when ``ucxx`` imports."""
    try:
        import ucxx  # noqa: F401 - importing is the check (a broken install fails here too)
    except ImportError as exc:
        return (
            f"--kv-transport ucx needs the ucxx package, which failed to import ({exc}); "
            "install it (pip install ucxx-cu12, Linux x86-64) or pass --kv-transport tcp"
        )
    return None


def require(transport: str, prog: str) -> None:
    """Exit with one clear line if ``transport`` cannot run in this install."""
    if transport == "ucx" and (problem := ucx_problem()) is not None:
        raise SystemExit(f"{prog}: {problem}")


def pick(requested: str | None) -> tuple[str, str | None]:
    """The transport ``tandem up`` runs with, and a note to print when it had to choose TCP."""
    if requested is not None:
        return requested, None
    problem = ucx_problem()
    if problem is None:
        return "ucx", None
    return "tcp", "tandem up: ucxx is not installed here; moving KV over TCP (--kv-transport tcp)"

"""How a tandem process starts another tandem process: ``python -P -m tandem.cli <command> ...``.

Who calls: ``tandem up`` (its routers and workers), the calibration and validation harnesses
(``tandem up`` itself), the operator's planner (``tandem plan``), and ``tandem profile`` (its KV
transfer peer, ``module_argv``).

``-P`` (Python 3.11+ safe-path mode) keeps the working directory off the child's ``sys.path``.
Started from a checkout, the repo root's folders would otherwise shadow installed packages of
the same name: ``kernels/`` hides Hugging Face's ``kernels``, which transformers imports since
5.25, and every child that loads a tokenizer fails. The flag goes on each child's command line,
not into the environment as ``PYTHONSAFEPATH``: inherited, that would also take a script's own
folder off the path of every script a child runs."""

from __future__ import annotations

import sys
from collections.abc import Sequence

CLI_MODULE = "tandem.cli"
PREFIX = ("-P", "-m", CLI_MODULE)  # what every tandem child's argv holds after the python


def module_argv(module: str, *args: str, python: str = sys.executable) -> tuple[str, ...]:
    """The argv that runs ``python -m <module> <args>`` in safe-path mode."""
    return (python, "-P", "-m", module, *args)


def tandem_argv(*args: str, python: str = sys.executable) -> tuple[str, ...]:
    """The argv that runs ``tandem <args>`` in a fresh interpreter."""
    return module_argv(CLI_MODULE, *args, python=python)


def subcommand(argv: Sequence[str]) -> str | None:
    """The tandem subcommand (``router``, ``prefill``, ...) a process runs, from its argv as
    ``/proc/PID/cmdline`` gives it; None for any other process."""
    n = len(PREFIX)
    if len(argv) > n + 1 and tuple(argv[1 : n + 1]) == PREFIX:
        return argv[n + 1]
    return None

"""A digest of the Tandem code a benchmark's processes run, to refuse a run whose code changed.

A long benchmark starts fresh `tandem up` processes case after case, and each imports (and, for
the CPU kernels, compiles) the code it finds at that moment. In a checkout that is the working
tree, so an edit during the run changes what later cases run. Planning round 16 lost a run that
way: a kernel edit that did not compile put every later worker on the PyTorch path, 5-7 times
slower per decode step than the profile it was judged against. A harness takes the digest when
it starts and checks it before each case (``SourceGuard``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

SOURCE_SUFFIXES = (".py", ".cpp", ".h")


def tandem_roots() -> list[Path]:
    """The installed ``tandem`` package's folders (a checkout's ``tandem_pkg``, whose
    subpackages are links to the repo's top-level folders)."""
    import tandem

    return [Path(p) for p in tandem.__path__]


def source_digest(roots: Iterable[Path]) -> str:
    """SHA-256 over every source file under ``roots`` (links followed): its path relative to
    its root and its bytes, in sorted order. Caches and data files do not count."""
    digest = hashlib.sha256()
    for root in roots:
        files = []
        for folder, dirs, names in os.walk(root, followlinks=True):
            dirs[:] = [d for d in dirs if d != "__pycache__"]  # the files are sorted below
            files += [Path(folder, n) for n in names if n.endswith(SOURCE_SUFFIXES)]
        for path in sorted(files):
            digest.update(str(path.relative_to(root)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


class SourceGuard:
    """Taken at a run's start; ``check`` before each case raises when the code has changed."""

    def __init__(self, roots: Iterable[Path] | None = None) -> None:
        self.roots = list(roots) if roots is not None else tandem_roots()
        self.digest = source_digest(self.roots)

    def check(self, what: str) -> None:
        if source_digest(self.roots) != self.digest:
            raise SystemExit(
                f"the Tandem source under {', '.join(map(str, self.roots))} changed since this "
                f"run started: stopping before {what}, which would run other code than the "
                "profile measured (keep the checkout unchanged while a run goes)"
            )

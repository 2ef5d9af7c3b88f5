"""Build the CPU kernels' shared library at first use, cache it, load it; or say why not, once.

Called by :mod:`tandem.kernels.cpu_ops` the first time a CPU kernel is asked for (the engine asks
at start-up). ``cpu_kernels.cpp`` is plain C ABI with no torch headers, so one ``c++ -O3
-fopenmp`` run takes a second or two; the result lives under ``~/.cache/tandem/cpu_kernels``
(``$XDG_CACHE_HOME`` or ``$TANDEM_KERNEL_CACHE`` if set), named by a hash of the source, the
compiler's version, the flags and the CPU's model and flags, so an edit, a new compiler or another
CPU builds afresh and nothing stale is ever loaded. The build writes a temporary file and renames
it into place, so processes building at once never load a half-written library.

Where the library cannot be built or loaded (no compiler, a compile error, an unsupported
platform) :func:`load` logs one warning and returns None, and callers keep the PyTorch path.
``TANDEM_CPU_KERNELS=0`` forces that fallback (tests use it; so can a user chasing a suspected
kernel bug).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = tuple(
    _HERE / f for f in ("cpu_kernels.cpp", "cpu_attention.cpp", "cpu_linear.cpp", "cpu_forward.cpp")
)
HEADERS = (_HERE / "cpu_kernels.h", _HERE / "cpu_simd.h", _HERE / "cpu_attention_block.h")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
ABI_VERSION = 4
DISABLE_ENV = "TANDEM_CPU_KERNELS"
_BUILD_TIMEOUT_S = 300


class BuildError(RuntimeError):
    """The library could not be built or loaded; the message says why."""


def cache_dir() -> Path:
    explicit = os.environ.get("TANDEM_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tandem" / "cpu_kernels"


def _cpu_identity() -> str:
    """The CPU's model and feature flags: -march=native code must not move to another CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        raise BuildError(f"no C++ compiler ({cxx!r} not found)")
    return path


def library_path(compiler: str) -> Path:
    """Where the library built from the current source by this compiler for this CPU lives."""
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"{compiler} --version failed: {exc}") from exc
    digest = hashlib.sha256()
    sources = [f.read_bytes() for f in (*SOURCES, *HEADERS)]
    for part in (*sources, version.encode(), " ".join(FLAGS).encode()):
        digest.update(part)
        digest.update(b"\0")
    digest.update(_cpu_identity().encode())
    return cache_dir() / f"tandem_cpu_kernels-{digest.hexdigest()[:20]}.so"


def build(compiler: str, target: Path) -> None:
    """Compile SOURCES into target (atomically: a temporary file renamed into place)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [compiler, *FLAGS, *map(str, SOURCES), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=_BUILD_TIMEOUT_S,
        )
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or ["no output"])[0]
            raise BuildError(f"{Path(compiler).name} exited {proc.returncode}: {first}")
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"compiling the CPU kernels failed: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_and_load() -> ctypes.CDLL:
    """Load the cached library, building it first if needed; BuildError says what failed."""
    if platform.system() != "Linux":
        raise BuildError(f"CPU kernels are built for Linux only, not {platform.system()}")
    compiler = _compiler()
    path = library_path(compiler)
    if not path.is_file():
        build(compiler, path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise BuildError(f"loading {path} failed: {exc}") from exc
    version = lib.tandem_cpu_abi_version()
    if version != ABI_VERSION:
        raise BuildError(f"{path} has ABI version {version}, expected {ABI_VERSION}")
    return lib


@functools.cache
def load() -> ctypes.CDLL | None:
    """The library, or None (with one warning) where it cannot be had. Cached per process."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        log.warning("CPU kernels disabled by %s=0; using the PyTorch path", DISABLE_ENV)
        return None
    # torch first: its libgomp must be the one this library binds to (one OpenMP thread pool).
    import torch  # noqa: F401

    try:
        return build_and_load()
    except BuildError as exc:
        log.warning("CPU kernels unavailable (%s); using the PyTorch path", exc)
        return None

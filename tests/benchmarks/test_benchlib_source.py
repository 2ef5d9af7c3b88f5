"""benchlib.source: the digest of the code a benchmark's processes run, and the guard on it."""

from pathlib import Path

import pytest
from benchlib.source import SourceGuard, source_digest, tandem_roots


def _tree(root: Path) -> Path:
    """A package whose subpackage is a link to a folder beside it, as a checkout's tandem_pkg."""
    (root / "engine").mkdir(parents=True)
    (root / "engine" / "step.py").write_text("STEP = 1\n")
    (root / "engine" / "kernel.cpp").write_text("int f() { return 1; }\n")
    pkg = root / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "engine").symlink_to(root / "engine", target_is_directory=True)
    return pkg


def test_the_digest_follows_links_and_counts_source_files_only(tmp_path: Path) -> None:
    pkg = _tree(tmp_path)
    before = source_digest([pkg])
    assert source_digest([pkg]) == before  # stable
    # Caches and data files do not count.
    (tmp_path / "engine" / "__pycache__").mkdir()
    (tmp_path / "engine" / "__pycache__" / "step.cpython-311.pyc").write_bytes(b"\x00")
    (tmp_path / "engine" / "weights.safetensors").write_bytes(b"\x01")
    assert source_digest([pkg]) == before
    # An edit behind the link does, in C++ as in Python.
    (tmp_path / "engine" / "kernel.cpp").write_text("int f() { return 2; }\n")
    edited = source_digest([pkg])
    assert edited != before
    (tmp_path / "engine" / "kernel.cpp").write_text("int f() { return 1; }\n")
    assert source_digest([pkg]) == before
    # So does a renamed module with the same bytes.
    (tmp_path / "engine" / "step.py").rename(tmp_path / "engine" / "steps.py")
    assert source_digest([pkg]) not in (before, edited)


def test_the_guard_stops_a_run_whose_code_changed(tmp_path: Path) -> None:
    pkg = _tree(tmp_path)
    guard = SourceGuard([pkg])
    guard.check("case 1")  # unchanged: nothing happens
    (tmp_path / "engine" / "step.py").write_text("STEP = 2\n")
    with pytest.raises(SystemExit, match="changed since this run started: stopping before case 2"):
        guard.check("case 2")


def test_the_default_roots_are_the_installed_package() -> None:
    import tandem

    roots = tandem_roots()
    assert roots == [Path(p) for p in tandem.__path__]
    assert any((r / "engine" / "engine.py").is_file() for r in roots)

"""Compatibility fingerprints: the same model and settings agree, anything that changes the KV
(weights of the same shapes included) disagrees, and the digest fits a Kubernetes label."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from checkpoints import write_random_checkpoint

from tandem.engine.fingerprint import DIGEST_CHARS, compute, model_digest


def fp(path: Path, dtype: str = "float32", block: int = 16, heads: int = 2) -> str:
    return compute(path, dtype, block, 2, heads, 16).digest


def test_same_model_same_fingerprint_and_a_copy_too(tmp_path: Path) -> None:
    a = write_random_checkpoint(tmp_path / "a", "llama", seed=1)
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    assert fp(a) == fp(a) == fp(copy)
    assert re.fullmatch(r"[0-9a-f]+", fp(a)) and len(fp(a)) == DIGEST_CHARS


def test_anything_that_changes_the_kv_changes_it(tmp_path: Path) -> None:
    a = write_random_checkpoint(tmp_path / "a", "llama", seed=1)
    b = write_random_checkpoint(tmp_path / "b", "llama", seed=2)  # same shapes, other values
    assert model_digest(a) != model_digest(b)
    base = fp(a)
    assert len({base, fp(b), fp(a, dtype="bfloat16"), fp(a, block=32), fp(a, heads=4)}) == 5
    f = compute(a, "float32", 16, 2, 2, 16)
    assert "float32" in f.describe() and f.model in f.describe() and "block 16" in f.describe()

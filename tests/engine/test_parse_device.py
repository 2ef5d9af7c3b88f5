"""The engine's device argument: a device this machine lacks is one ValueError naming it, before
any weights load (`tandem profile --device cuda` on a CPU-only machine was a traceback)."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.builder import parse_device
from tandem.profile import main as profile_main

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def test_cpu_is_accepted() -> None:
    assert parse_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize(("name", "match"), [
    ("gpu", "device 'gpu' is not a torch device"),
    ("meta", "device 'meta': the engine runs on cpu or cuda only"),
    ("cuda:x", "device 'cuda:x' is not a torch device"),
])  # fmt: skip
def test_unknown_devices_are_named(name: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_device(name)


@no_cuda
def test_cuda_without_a_device_is_named() -> None:
    with pytest.raises(ValueError, match="device 'cuda:1': this machine's torch sees no CUDA"):
        parse_device("cuda:1")


@no_cuda
def test_profile_on_missing_cuda_exits_with_one_line(tmp_path) -> None:
    out = tmp_path / "p.json"
    with pytest.raises(SystemExit) as exc:
        profile_main(["--device", "cuda", "--output", str(out), "--transports", "tcp"])
    assert (
        str(exc.value) == "tandem profile: device 'cuda': this machine's torch sees no CUDA device"
    )
    assert not out.exists()

"""Where a kernel may run, and the checks every wrapper makes before launching.

Wrappers call :func:`check_launchable` before each launch. Triton compiles for CUDA; on a machine
without a GPU the same kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (the CI path), which
must be set before ``triton`` is first imported.
"""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its Python interpreter (CPU tensors allowed)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_launchable(name: str, *tensors: torch.Tensor) -> None:
    """Raise ValueError unless all tensors share one device that Triton can run on."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: tensors are on several devices: {sorted(map(str, devices))}")
    device = next(iter(devices))
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreting():
        return
    raise ValueError(
        f"{name}: Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), "
        f"got device {device}"
    )


def check_on_cpu(name: str, *tensors: torch.Tensor) -> None:
    """The CPU kernels (:mod:`tandem.kernels.cpu_ops`) read host memory only."""
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"{name}: CPU kernels need CPU tensors, got device {t.device}")


def check_shape(name: str, what: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Raise ValueError naming the argument when t's shape differs from shape."""
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: {what} must have shape {shape}, got {tuple(t.shape)}")


def check_dtype(name: str, what: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    """Raise ValueError naming the argument when t's dtype is not one of dtypes."""
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: {what} must have dtype in ({allowed}), got {t.dtype}")


def check_last_dim_contiguous(name: str, what: str, t: torch.Tensor) -> None:
    """Kernels vectorise over the last dimension, so it must have stride 1."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: {what} must have stride 1 in its last dimension")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

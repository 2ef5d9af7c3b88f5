"""Attention backends by name: the one place that knows the implementations.

Called by the engine once at start-up (``EngineConfig.attention_backend``, or triton on CUDA and
torch on CPU) and by tests. Kept out of :mod:`tandem.engine.attention.backend` so that the
interface imports no implementation: each implementation imports the interface, never the reverse.
"""

from __future__ import annotations

from tandem.engine.attention.backend import AttentionBackend


def get_backend(name: str, *, cpu_kernels: bool = True) -> AttentionBackend:
    """Resolve a backend by name: 'torch' (CPU and reference) or 'triton' (CUDA or interpreter).

    cpu_kernels: whether the torch backend may use the CPU kernels (``EngineConfig.cpu_kernels``).
    """
    # Imported on demand: the triton backend imports triton, which CPU-only installs may lack.
    if name == "torch":
        from tandem.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(cpu_kernels=cpu_kernels)
    if name == "triton":
        from tandem.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be 'torch' or 'triton', got {name!r}")

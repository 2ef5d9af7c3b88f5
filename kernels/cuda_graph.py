"""CUDA-graph capture and replay of decode steps at padded batch sizes.

The ModelRunner builds one :class:`DecodeGraphRunner` at start-up around its decode forward, calls
:meth:`DecodeGraphRunner.capture` once (after the KV cache is allocated, since graphs bake in
its address), then calls :meth:`DecodeGraphRunner.run` each decode step. A batch of n sequences
replays the graph of the smallest captured size >= n; the padding rows get each input's pad value
(e.g. slot -1 so the KV write skips them, seq_len 0 so attention yields zeros). Batches larger
than every captured size, and runners built with enabled=False, run eagerly.

Without CUDA the runner still pads and copies into its static buffers and calls the function
eagerly on them, so the padding logic is testable on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

GraphFn = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True, slots=True)
class GraphInput:
    """One batch-indexed input: buffer [max_batch_size, *tail_shape], rows >= n set to pad_value."""

    name: str
    tail_shape: tuple[int, ...]
    dtype: torch.dtype
    pad_value: int | float


def capture_batch_sizes(max_batch_size: int) -> list[int]:
    """Powers of two up to max_batch_size, plus max_batch_size itself: [1, 2, 4, ..., max]."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = []
    size = 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    sizes.append(max_batch_size)
    return sizes


def padded_batch_size(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest size in sizes that holds n rows, or None when n exceeds them all."""
    fitting = [s for s in sizes if s >= n]
    return min(fitting) if fitting else None


class DecodeGraphRunner:
    """Owns static input buffers, one output buffer per size and one CUDA graph per size.

    fn must read only the given input views (and tensors it closes over, such as weights and the
    KV cache, whose addresses must not change after capture) and return a tensor whose first
    dimension is the batch. The tensor returned by :meth:`run` is a view of a static buffer that
    the next run overwrites: the caller must consume or copy it first.
    """

    def __init__(
        self,
        fn: GraphFn,
        inputs: Sequence[GraphInput],
        max_batch_size: int,
        device: torch.device | str,
        *,
        batch_sizes: Sequence[int] | None = None,
        enabled: bool = True,
    ) -> None:
        names = [spec.name for spec in inputs]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"inputs must be non-empty with unique names, got {names}")
        sizes = sorted(set(batch_sizes or capture_batch_sizes(max_batch_size)))
        if sizes[0] < 1 or sizes[-1] > max_batch_size:
            raise ValueError(f"batch sizes must lie in [1, {max_batch_size}], got {sizes}")
        self._fn = fn
        self._specs = {spec.name: spec for spec in inputs}
        self._sizes = sizes
        self._device = torch.device(device)
        self._enabled = enabled
        self._buffers = {
            spec.name: torch.full(
                (max_batch_size, *spec.tail_shape),
                spec.pad_value,
                dtype=spec.dtype,
                device=self._device,
            )  # fmt: skip
            for spec in inputs
        }
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    @property
    def batch_sizes(self) -> list[int]:
        return list(self._sizes)

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def _views(self, size: int) -> dict[str, torch.Tensor]:
        return {name: buf[:size] for name, buf in self._buffers.items()}

    def capture(self, warmup_iters: int = 2) -> None:
        """Capture one graph per batch size, largest first so smaller graphs reuse its memory pool.

        Needs CUDA; a disabled runner captures nothing. Inputs hold their pad values meanwhile.
        """
        if not self._enabled:
            return
        if self._device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        pool = None
        stream = torch.cuda.Stream(self._device)
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            for size in reversed(self._sizes):
                for _ in range(warmup_iters):
                    self._fn(self._views(size))
        torch.cuda.current_stream(self._device).wait_stream(stream)
        for size in reversed(self._sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self._fn(self._views(size))
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize(self._device)

    def run(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Run fn on a batch of n rows (every input's first dimension); returns rows [:n]."""
        if set(inputs) != set(self._specs):
            raise ValueError(f"expected inputs {sorted(self._specs)}, got {sorted(inputs)}")
        counts = {t.shape[0] for t in inputs.values()}
        if len(counts) != 1:
            raise ValueError(f"inputs disagree on the batch size: {sorted(counts)}")
        n = counts.pop()
        for name, t in inputs.items():
            spec = self._specs[name]
            if tuple(t.shape[1:]) != spec.tail_shape or t.dtype != spec.dtype:
                raise ValueError(
                    f"input {name}: expected [n, {spec.tail_shape}] {spec.dtype}, "
                    f"got {tuple(t.shape)} {t.dtype}"
                )
        size = padded_batch_size(n, self._sizes) if self._enabled else None
        if size is None or n == 0:
            return self._fn(inputs)
        for name, buf in self._buffers.items():
            buf[:n].copy_(inputs[name], non_blocking=True)
            buf[n:size].fill_(self._specs[name].pad_value)
        graph = self._graphs.get(size)
        if graph is None:
            return self._fn(self._views(size))[:n]
        graph.replay()
        return self._outputs[size][:n]

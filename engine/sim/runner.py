"""``SimulatedRunner``: a ``StepRunner`` that waits the profiled step time instead of computing.

Everything around it is real (scheduler, block pool, prefix cache, KV events, role hooks, the
worker shell); only the forward pass is replaced. ``execute`` measures nothing: it waits until
``execute_seconds(batch)`` after it was called, then returns one deterministic token per sampled
row (``tokens.sample``). Its ``kv_cache`` is a meta tensor with the real layout's shape and
dtype: the KV connector can name and size block views over it, and no memory backs them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tandem.engine.kv_layout import KVLayout
from tandem.engine.outputs import ModelRunnerOutput, SchedulerOutput
from tandem.engine.sim.cost_model import StepCost
from tandem.engine.sim.tokens import sample


class SimulatedRunner:
    """Owned by the Engine, called on the engine thread (see ``StepRunner``)."""

    def __init__(
        self,
        cost: StepCost,
        layout: KVLayout,
        token_ids: tuple[int, ...],
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not token_ids:
            raise ValueError("a simulated runner needs at least one token id to emit")
        self.cost = cost
        self.layout = layout
        self.device = torch.device("cpu")
        self.kv_cache = torch.empty(layout.shape, dtype=layout.torch_dtype, device="meta")
        self._tokens = token_ids
        self._clock = clock
        self._sleep = sleep
        self.num_steps = 0
        self.simulated_seconds = 0.0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        start = self._clock()
        seconds = self.cost.execute_seconds(
            (s.num_new_tokens, s.request.num_computed_tokens) for s in out.scheduled
        )
        result = sample(out, self._tokens)
        self.num_steps += 1
        self.simulated_seconds += seconds
        remaining = start + seconds - self._clock()
        if remaining > 0:
            self._sleep(remaining)
        return result

"""``StepRunner``: the engine's view of its model runner, the seam a simulated runner plugs into.

The Engine calls ``execute`` once per non-empty step with the scheduler's output, on the engine
thread, and hands the result to ``Scheduler.update``. ``ModelRunner`` (model_runner.py) runs the
model; ``tandem.engine.sim.runner.SimulatedRunner`` waits the profiled step time and emits
deterministic tokens. ``kv_cache`` is the tensor the role's KV connector reads (prefill) or
writes (decode); ``device`` is where per-request sampling generators are created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from tandem.engine.outputs import ModelRunnerOutput, SchedulerOutput


class StepRunner(Protocol):
    device: torch.device
    kv_cache: torch.Tensor

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; a token for every scheduled row with ``sample`` set. The scheduler
        still owns every block; the runner only reads and writes the KV of ``out``'s rows."""
        ...

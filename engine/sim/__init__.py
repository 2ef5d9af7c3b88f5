"""Simulation support in the engine core: the profiled cost model and the simulated runner.

``cost_model`` turns a batch's shape into seconds (linear models fitted by ``tandem profile``);
``profile`` is the profile JSON (raw points plus the fitted models); ``tokens`` is the one
deterministic token rule that simulated workers and the discrete-event simulator share;
``runner`` is the ``StepRunner`` that waits the profiled step time instead of running a model;
``builder`` makes ``EngineParts`` around it without loading weights; ``profiler`` measures the
real engine. Everything but ``runner``, ``builder`` and ``profiler`` is torch-free, so the
planner (``tandem.planner``) can use it without loading torch.
"""

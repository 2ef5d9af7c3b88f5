"""P/D against colocated serving under SLOs (``benchmarks/pd_vs_colocated.py``).

Modules: ``workloads`` and ``deployments`` (what is compared, pure), ``guidellm_driver`` (the load
generator's command line and report), ``canary`` (per-chunk stream timing guidellm does not
record), ``slo`` (unloaded references, attainment, goodput: pure), ``summary`` (the tables and
ratios), ``plots``, ``runner`` (one repeat over every deployment) and ``cli``."""

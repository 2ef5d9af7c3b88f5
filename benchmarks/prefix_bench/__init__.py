"""The prefix-aware routing benchmark (``benchmarks/prefix_routing.py``): multi-turn chat
sessions against a sticky-session oracle. Modules: ``workload`` (sessions and their client),
``oracle``, ``measure`` (one run on a deployment, summaries), ``report`` and ``cli``."""

"""Tandem planner: a discrete-event simulator over the engine's own scheduler, and ``tandem plan``.

``workload`` generates requests (arrivals, lengths, shared prefixes) from a seed;
``simulator.simulate`` runs a deployment on a virtual clock (``events``) with one ``SimWorker``
per worker (``sim_worker``: the real Scheduler, KVCacheManager, BlockPool and role hooks, steps
timed by the profile's cost model), a router doing the real placement (``sim_router``:
``tandem.router.placement`` and its ``PrefixIndex`` fed by the pools' KV events) and KV transfers
timed by the profile (``sim_kv``); ``metrics`` turns per-request times into the client's TTFT,
ITL and end-to-end latency; ``search`` is the deployment search behind ``tandem plan`` (``cli``).
No processes, no HTTP, no torch: thousands of simulated requests per second of wall time.
"""

"""Prefix-aware vs round-robin routing on a multi-turn chat workload, against a sticky oracle.

Workload: ``--sessions`` chat sessions of ``--turns`` turns. Turn t sends, through
``/v1/chat/completions`` (the model's chat template), the whole history of turns < t (user messages
and the assistant's actual replies) plus a new user message of about ``--user-chars`` characters.
A session's next turn starts only after its previous one finished, as a chat client would, and at
most ``--concurrency`` turns are in flight. Replies have a fixed length: ``max_tokens`` with
``ignore_eos``, greedy. Two seeded schedules:

- open loop (default): sessions arrive at ``--session-rate`` per second (Poisson) and think
  ``--think-s`` seconds (exponential) between turns. Every policy faces the same offered load, so
  TTFT compares like with like. The TTFT gap depends on the load: light load leaves round-robin's
  median request a cheap one (its lucky hits and first turns), overload queues everything. The
  default 0.7 sits near round-robin's capacity on 2 busy CPU cores (its closed-loop req/s divided
  by ``--turns``); scale it with the machine.
- closed loop (``--session-rate 0``): a shuffled order of all turns, the earliest turn whose
  session is idle goes next. The saved prefill shows as throughput and end-to-end latency: the
  next turns take the freed capacity at once, so TTFT stays near saturation for every policy.

Model: by default a random-weight Llama written to a temp dir (``--hidden`` 384, ``--layers`` 6,
GQA, vocab 4096, 2048 context) with the demo's byte-level tokenizer and chat template (one token
per byte): big enough that prefill, not per-token serving overhead, dominates a worker's time on a
CPU. Its output head is zero outside printable ASCII, so greedy replies are ASCII text that
tokenizes back to exactly the generated ids, and the history a client sends back is the history
the worker cached.

Sticky-session oracle: each session pinned to one worker, no eviction. A turn's prompt then hits
the longest common prefix with any earlier turn's computed tokens (its prompt plus its reply less
the last token, whose KV is never computed), in full blocks, leaving at least one prompt token to
compute (the engine's own cap). It is computed from each run's own transcript with the model's
tokenizer, exactly as the router tokenizes.

Per policy (``tandem up --prefill 0 --decode N --policy P``, one deployment per policy, same
workload and seed): the workers' prefix-cache hit rate (deltas of
``tandem_prefix_cache_{hit,queried}_tokens_total``), the same from the responses'
``usage.prompt_tokens_details.cached_tokens``, the oracle rate, TTFT p50/p90 (client side, time to
the first content chunk), throughput and the router's placement reasons. ``--repeats`` runs
each policy on several fresh deployments, alternating the order, and pools the requests (a shared
machine drifts). Prints a table and JSON (``--json`` adds every request's TTFT, cached and oracle
tokens).

    python benchmarks/prefix_routing.py --launch            # random Llama, 2 colocated workers
    TANDEM_CLUSTER_TOKEN=... python benchmarks/prefix_routing.py --router-url
        http://127.0.0.1:8000 --internal-url http://127.0.0.1:8001 --model-dir DIR

The code is the ``prefix_bench`` package beside this file.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefix_bench.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(__doc__))

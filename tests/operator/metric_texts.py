"""Prometheus exposition fixtures shared by the metrics and end-to-end tests."""

from __future__ import annotations


def router_text(t: int) -> str:
    """Router exposition after t ticks: 10 generate requests per tick, all TTFTs in (0.5, 1],
    ITLs 40 per tick in (0.01, 0.05] and 10 per tick in (0.05, 0.1]."""
    return f"""# HELP tandem_router_requests_total Requests.
# TYPE tandem_router_requests_total counter
tandem_router_requests_total{{model="demo",route="/v1/completions",code="200"}} {10 * t}
tandem_router_requests_total{{model="demo",route="/health",code="200"}} {100 * t}
# TYPE tandem_time_to_first_token_seconds histogram
tandem_time_to_first_token_seconds_bucket{{model="demo",le="0.1"}} 0
tandem_time_to_first_token_seconds_bucket{{model="demo",le="0.5"}} 0
tandem_time_to_first_token_seconds_bucket{{model="demo",le="1.0"}} {10 * t}
tandem_time_to_first_token_seconds_bucket{{model="demo",le="+Inf"}} {10 * t}
tandem_time_to_first_token_seconds_count{{model="demo"}} {10 * t}
tandem_time_to_first_token_seconds_sum{{model="demo"}} {8 * t}
# TYPE tandem_inter_token_latency_seconds histogram
tandem_inter_token_latency_seconds_bucket{{model="demo",le="0.01"}} 0
tandem_inter_token_latency_seconds_bucket{{model="demo",le="0.05"}} {40 * t}
tandem_inter_token_latency_seconds_bucket{{model="demo",le="0.1"}} {50 * t}
tandem_inter_token_latency_seconds_bucket{{model="demo",le="+Inf"}} {50 * t}
tandem_inter_token_latency_seconds_count{{model="demo"}} {50 * t}
tandem_inter_token_latency_seconds_sum{{model="demo"}} {2 * t}
"""


def worker_text(role: str, t: int, waiting: float, running: float, kv: float) -> str:
    counter = (
        "tandem_prompt_tokens_total" if role == "prefill" else "tandem_generation_tokens_total"
    )
    per_tick = 1000 if role == "prefill" else 200
    return f"""# TYPE tandem_requests_waiting gauge
tandem_requests_waiting{{model="demo",role="{role}"}} {waiting}
# TYPE tandem_requests_running gauge
tandem_requests_running{{model="demo",role="{role}"}} {running}
# TYPE tandem_kv_cache_usage_ratio gauge
tandem_kv_cache_usage_ratio{{model="demo",role="{role}"}} {kv}
# TYPE {counter[: -len("_total")]} counter
{counter}{{model="demo",role="{role}"}} {per_tick * t}
"""


# The TTFT and ITL p90 the fixtures imply: 0.5 + 0.5 * 0.9, and 0.05 + 0.05 * (45 - 40) / 10.
TTFT_P90 = 0.95
ITL_P90 = 0.075

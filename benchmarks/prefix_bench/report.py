"""The printed table and the targets' summary of the prefix-routing benchmark."""

from __future__ import annotations

from typing import Any

TARGET_HIT_VS_ORACLE = 0.90
TARGET_TTFT_SPEEDUP = 1.5


def table(results: dict[str, dict[str, Any]]) -> str:
    cols = [("policy", "{}"), ("hit rate", "{:.3f}"), ("oracle", "{:.3f}"),
            ("hit/oracle", "{:.3f}"), ("TTFT p50 ms", "{:.1f}"), ("TTFT p90 ms", "{:.1f}"),
            ("e2e mean ms", "{:.1f}"), ("req/s", "{:.2f}"), ("out tok/s", "{:.1f}")]  # fmt: skip
    keys = [None, "hit_rate", "oracle_hit_rate", "hit_vs_oracle", "ttft_p50_ms", "ttft_p90_ms",
            "e2e_mean_ms", "throughput_rps", "output_tok_s"]  # fmt: skip
    rows = [[name] + [fmt.format(r[k] or 0) for (_, fmt), k in zip(cols[1:], keys[1:],
                                                                     strict=True)]
            for name, r in results.items()]  # fmt: skip
    head = [c for c, _ in cols]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    lines = [" | ".join(x.ljust(w) for x, w in zip(row, widths, strict=True))
             for row in [head, *rows]]  # fmt: skip
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    pa, rr = results.get("prefix-aware"), results.get("round-robin")
    if pa is not None:
        out["hit_vs_oracle"] = pa["hit_vs_oracle"]
        out["hit_target_met"] = (pa["hit_vs_oracle"] or 0) >= TARGET_HIT_VS_ORACLE
    if pa is not None and rr is not None:
        speedup = rr["ttft_p50_ms"] / pa["ttft_p50_ms"]
        out["ttft_p50_speedup_rr_over_pa"] = round(speedup, 3)
        out["ttft_p90_speedup_rr_over_pa"] = round(rr["ttft_p90_ms"] / pa["ttft_p90_ms"], 3)
        out["ttft_target_met"] = speedup >= TARGET_TTFT_SPEEDUP
        out["e2e_mean_speedup_rr_over_pa"] = round(rr["e2e_mean_ms"] / pa["e2e_mean_ms"], 3)
        out["throughput_ratio_pa_over_rr"] = round(pa["throughput_rps"] / rr["throughput_rps"], 3)
    return out

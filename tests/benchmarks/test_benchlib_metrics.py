"""benchlib.metrics.histogram_quantile: Prometheus's answer over what a histogram counted
between two scrapes, exactly."""

import math

from benchlib.metrics import histogram_quantile, parse

NAME = "tandem_worker_time_to_first_token_seconds"


def scrape_text(counts: dict[str, float]) -> str:
    lines = [f"# TYPE {NAME} histogram"]
    for role in ("prefill", "decode"):  # two series: their buckets add up
        for le, n in counts.items():
            lines.append(f'{NAME}_bucket{{le="{le}",model="demo",role="{role}"}} {n}')
        lines.append(f'{NAME}_count{{model="demo",role="{role}"}} {counts["+Inf"]}')
        lines.append(f'{NAME}_sum{{model="demo",role="{role}"}} 0.0')
    return "\n".join(lines) + "\n"


def test_the_quantile_interpolates_within_the_bucket_of_what_was_counted_between_scrapes() -> None:
    before = parse(scrape_text({"0.005": 3, "0.01": 3, "0.02": 3, "+Inf": 3}))
    # Counted since: per series 2 under 5 ms, 6 in 5-10 ms, 2 in 10-20 ms (10 each, 20 in all).
    after = parse(scrape_text({"0.005": 5, "0.01": 11, "0.02": 13, "+Inf": 13}))
    # p90: rank 18 of 20; the 10-20 ms bucket holds ranks 17-20: 10 + 10 * (18 - 16) / 4 ms.
    assert histogram_quantile(0.9, before, after, NAME) == 0.015
    # p50: rank 10; the 5-10 ms bucket holds ranks 5-16: 5 + 5 * (10 - 4) / 12 ms.
    assert histogram_quantile(0.5, before, after, NAME) == 0.0075


def test_beyond_the_last_bound_it_answers_that_bound_and_nothing_counted_is_nan() -> None:
    empty = parse(scrape_text({"0.005": 0, "0.01": 0, "0.02": 0, "+Inf": 0}))
    slow = parse(scrape_text({"0.005": 0, "0.01": 0, "0.02": 1, "+Inf": 4}))
    assert histogram_quantile(0.9, empty, slow, NAME) == 0.02
    assert math.isnan(histogram_quantile(0.9, empty, empty, NAME))

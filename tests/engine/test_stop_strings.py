"""StopMatcher against brute force: first match to complete, longest among ties, and the
hold-back (longest suffix that is a proper prefix of a stop), however the text is split."""

from __future__ import annotations

import random

import pytest

from tandem.engine.stop_strings import StopMatcher


def brute_first_match(text: str, stops: list[str]) -> tuple[int, str] | None:
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            return end, max(hits, key=len)
    return None


def brute_holdback(text: str, stops: list[str]) -> int:
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def feed_split(m: StopMatcher, text: str, cuts: list[int]) -> tuple[int, str] | None:
    """Feed ``text`` in pieces; the match's end as an offset into the whole text."""
    start = 0
    for cut in [*cuts, len(text)]:
        piece = text[start:cut]
        hit = m.feed(piece)
        if hit is not None:
            return start + hit[0], hit[1]
        start = cut
    return None


def test_random_texts_and_splits_match_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(600):
        alphabet = "abc" if rng.random() < 0.7 else "ab中"
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
            for _ in range(rng.randint(1, 4))
        ]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(5, len(text)))))
        expected = brute_first_match(text, stops)
        assert feed_split(StopMatcher(stops), text, cuts) == expected, (text, stops, cuts)
        if expected is None:
            m = StopMatcher(stops)
            for i, ch in enumerate(text):
                assert m.feed(ch) is None
                assert m.holdback == brute_holdback(text[: i + 1], stops), (text, stops, i)


def test_longest_stop_wins_among_matches_ending_together() -> None:
    assert StopMatcher(["c", "bc", "abc"]).feed("xxabcx") == (5, "abc")
    assert StopMatcher(["abcd", "bc"]).feed("abcd") == (3, "bc")  # "bc" completes first


def test_self_overlapping_stop_strings() -> None:
    m = StopMatcher(["aab"])
    assert m.feed("aaaa") is None and m.holdback == 2
    assert m.feed("b") == (1, "aab")
    m = StopMatcher(["abac"])
    assert m.feed("ababa") is None and m.holdback == 3
    assert m.feed("c") == (1, "abac")


def test_long_stops_are_matched_without_rescanning() -> None:
    stop = "x" * 1023 + "y"
    m = StopMatcher([stop] * 3 + ["z" * 1024])
    for i in range(20):
        assert m.feed("x" * 800) is None
        assert m.holdback == (800 if i == 0 else 1023)
    assert m.feed("y") == (1, stop)


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["a", ""])

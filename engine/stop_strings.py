"""Streaming stop-string matching whose cost per call does not grow with the output.

The detokenizer (``detokenizer.py``) feeds each step's new text to one ``StopMatcher`` per
sequence. The matcher keeps, per stop string, the Knuth-Morris-Pratt state: the length of the
longest prefix of that stop string that is a suffix of all text fed so far. So each new
character costs amortized O(1) per stop string (at worst O(stop length)), never a rescan of the
output, and the text that a stop string may still claim, the part to hold back from the stream,
is exactly the largest of those states. Memory is O(total stop length).

Semantics (the detokenizer's contract): the stop is the first match to *complete* in the text
(smallest end offset); among matches ending at the same character, the longest wins. This
depends only on the text, never on how it was split into ``feed`` calls.
"""

from __future__ import annotations

from collections.abc import Sequence


def _failure(s: str) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper border of s[: i + 1]."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """Owned by one sequence's detokenizer; not thread-safe. Stop strings must be non-empty."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = list(dict.fromkeys(stops))
        self._fail = [_failure(s) for s in self._stops]
        self._state = [0] * len(self._stops)

    @property
    def holdback(self) -> int:
        """Length of the longest suffix of the text fed so far that is a proper prefix of some
        stop string: the characters a stop string may still claim."""
        return max(self._state, default=0)

    def feed(self, text: str) -> tuple[int, str] | None:
        """Advance over ``text``. On the first completed match, return ``(end, stop)`` where
        ``end`` is the offset in ``text`` just past the match; the rest of ``text`` is not fed
        (the sequence ends there). None when nothing completed."""
        stops, fails, state = self._stops, self._fail, self._state
        for pos, ch in enumerate(text):
            best = -1
            for i, s in enumerate(stops):
                k = state[i]
                while k and s[k] != ch:
                    k = fails[i][k - 1]
                if s[k] == ch:
                    k += 1
                if k == len(s):
                    if best < 0 or len(s) > len(stops[best]):
                        best = i
                    k = fails[i][k - 1]
                state[i] = k
            if best >= 0:
                return pos + 1, stops[best]
        return None

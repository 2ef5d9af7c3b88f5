"""Stop-string cost per token: the output processing's detokenizer with 16 stop strings, as the
output grows. The check must cost O(stop length) per token, never O(output) (issue: security,
"bounded requests"); before, 16 stops of 100 kB took 108 ms per token at 16k characters.

    python benchmarks/stop_strings.py [--stop-chars 1024 100000] [--outputs 1000 4000 16000]

For each stop length and output length it streams a byte-level output one token at a time
through ``IncrementalDetokenizer`` (what ``SequenceOutput`` runs per token at the router and in
the offline LLM) and reports the mean microseconds per token over the last 500 tokens. The stop
strings share long prefixes with the output, so the matcher holds text back and works at every
token: the adversarial case. The baseline in the same run is the previous implementation
(``git show b69cfe8:engine/detokenizer.py``, loaded from this repository's history), measured
on the same inputs while it stays under ``--baseline-budget`` seconds per point (``nan``: it
did not finish within the budget).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types
from pathlib import Path

from transformers import AutoTokenizer

from tandem.engine.demo import weights_path
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.sampling_params import SamplingParams

BASELINE_COMMIT = "b69cfe8"
WINDOW = 500


def baseline_class() -> type | None:
    repo = Path(__file__).resolve().parents[1]
    try:
        src = subprocess.run(
            ["git", "show", f"{BASELINE_COMMIT}:engine/detokenizer.py"],
            cwd=repo, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    mod = types.ModuleType("baseline_detokenizer")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    exec(compile(src, "baseline_detokenizer.py", "exec"), mod.__dict__)  # noqa: S102 - own repo
    return mod.IncrementalDetokenizer


def per_token_us(cls: type, tok, stops: list[str], out_ids: list[int], budget_s: float) -> float:  # noqa: ANN001
    det = cls(tok, [], SamplingParams(stop=stops, max_tokens=None))
    started = time.perf_counter()
    for t in out_ids[:-WINDOW]:
        det.append([t])
        if time.perf_counter() - started > budget_s:
            return float("nan")
    t0 = time.perf_counter()
    for t in out_ids[-WINDOW:]:
        det.append([t])
    return (time.perf_counter() - t0) / WINDOW * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stop-chars", type=int, nargs="+", default=[1024, 100_000])
    ap.add_argument("--outputs", type=int, nargs="+", default=[1000, 4000, 16000])
    ap.add_argument("--baseline-budget", type=float, default=60.0, metavar="SECONDS")
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(str(weights_path()), local_files_only=True)
    old = baseline_class()
    print("| stops | stop chars | output chars | now (µs/token) | before (µs/token) |")
    print("| --- | --- | --- | --- | --- |")
    for kind in ("shared", "foreign"):
        for length in a.stop_chars:
            # The output repeats "ab". Shared stops are "ab" * k + a distinct tail, foreign ones
            # "cd" * k + a tail: none ever matches.
            unit = "ab" if kind == "shared" else "cd"
            stops = [(unit * length)[: length - 1] + chr(ord("A") + i) for i in range(16)]
            for n in a.outputs:
                ids = tok.encode("ab" * (n // 2), add_special_tokens=False)
                now = per_token_us(IncrementalDetokenizer, tok, stops, ids, float("inf"))
                before = float("nan")
                if old is not None:
                    before = per_token_us(old, tok, stops, ids, a.baseline_budget)
                print(f"| 16 × {kind} | {length} | {n} | {now:.1f} | {before:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

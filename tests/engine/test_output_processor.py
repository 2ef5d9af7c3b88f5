"""SequenceOutput: the text made from a token stream where output leaves the system (router,
offline LLM). Exact cuts of tokens, logprobs and text at stop strings; continuity across the
prefill -> decode hand-off; finish reasons as the engine gave them."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from tandem.engine.demo import weights_path
from tandem.engine.output_processor import SequenceOutput, TextOptions


@pytest.fixture(scope="module")
def tok() -> Any:
    return AutoTokenizer.from_pretrained(str(weights_path()), local_files_only=True)


def ids(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_stop_string_cuts_tokens_logprobs_and_text_at_the_completing_token(tok: Any) -> None:
    seq = SequenceOutput.create(tok, ids(tok, "p"), TextOptions(("cd",)))
    toks = ids(tok, "abcdef")
    lps = [f"lp{i}" for i in range(len(toks))]
    first = seq.process(toks[:2], lps[:2])
    assert (first.text, first.token_ids, first.finish_reason) == ("ab", toks[:2], None)
    held = seq.process(toks[2:3], lps[2:3])
    assert held.text == "" and not held.stopped_by_string  # "c" may start the stop string
    d = seq.process(toks[3:], lps[3:])
    assert (d.text, d.token_ids, d.logprobs) == ("", toks[3:4], lps[3:4])
    assert (d.finish_reason, d.stop_reason, d.stopped_by_string) == ("stop", "cd", True)
    assert seq.token_ids == toks[:4] and seq.num_tokens == 4
    later = seq.process(toks[4:], (), "length")
    assert (later.token_ids, later.text, later.finish_reason) == ([], "", None)


def test_include_stop_str_and_stop_outranks_length_on_the_same_token(tok: Any) -> None:
    seq = SequenceOutput.create(tok, [], TextOptions(("cd",), include_stop_str_in_output=True))
    d = seq.process(ids(tok, "abcd"), (), "length")
    assert (d.text, d.finish_reason, d.stop_reason) == ("abcd", "stop", "cd")


def test_length_flushes_held_back_text_and_keeps_the_engines_reasons(tok: Any) -> None:
    seq = SequenceOutput.create(tok, [], TextOptions(("xyz",)))
    assert seq.process(ids(tok, "abx")).text == "ab"
    end = seq.process(ids(tok, "y"), (), "stop", 7)
    assert (end.text, end.finish_reason, end.stop_reason) == ("xy", "stop", 7)
    assert not end.stopped_by_string and seq.finished


def test_abort_and_error_leave_the_text_open(tok: Any) -> None:
    seq = SequenceOutput.create(tok, [], TextOptions(("bc",)))
    assert seq.process(ids(tok, "ab")).text == "a"
    d = seq.process([], (), "abort")
    assert (d.text, d.finish_reason, seq.finished) == ("", None, False)


def test_hand_off_continues_the_text_of_one_sequence(tok: Any) -> None:
    """Prefill's first token (finish remote_decode), then decode's tokens: the same text as the
    whole stream at once, multi-byte characters split across the two workers included."""
    prompt = ids(tok, "<|user|>reverse: x<|assistant|>")
    out = ids(tok, "é中b") + [tok.eos_token_id]
    whole = SequenceOutput.create(tok, prompt, TextOptions())
    expected = whole.process(out, (), "stop").text
    assert expected == "é中b"
    seq = SequenceOutput.create(tok, prompt, TextOptions())
    texts = [seq.process(out[:1], (), "remote_decode").text]
    texts += [seq.process([t]).text for t in out[1:-1]]
    texts.append(seq.process(out[-1:], (), "stop").text)
    assert "".join(texts) == expected and seq.finish_reason == "stop"

import random
from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.sampling_params import SamplingParams

TEXTS = [
    "héllo wörld",
    "中文字符 and ascii",
    "thumbs 👍🏽 up",
    "family 👨\u200d👩\u200d👧 emoji, flag 🇫🇷!",
    "naïve café — ünïcödé ∑ 𝄞 done",
]


@pytest.fixture(scope="module")
def byte_tok() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer with no merges: every UTF-8 byte is its own token."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def bpe_tok() -> PreTrainedTokenizerFast:
    """Byte-level BPE with learned merges, some of which split multi-byte characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"],
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def metaspace_tok() -> PreTrainedTokenizerFast:
    """SentencePiece-style tokenizer: a lone word decodes without its leading space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(["hello world the quick brown fox"] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.fixture(scope="module")
def llama_tok() -> PreTrainedTokenizerFast:
    """Llama-2/Mistral style: "▁" spaces, byte fallback for characters not in the vocab."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({c: 259 + i for i, c in enumerate("▁abcdefghijklmnopqrstuvwxyz")})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(
    tok: PreTrainedTokenizerFast,
    ids: Sequence[int],
    chunk: int = 1,
    prompt: Sequence[int] = (),
    **params: object,
) -> tuple[list[str], str | None, IncrementalDetokenizer]:
    """Feed `ids` in chunks; return the deltas (including finish()'s), the stop and the detok."""
    det = IncrementalDetokenizer(tok, list(prompt), SamplingParams(**params))
    deltas: list[str] = []
    for start in range(0, len(ids), chunk):
        step = det.append(ids[start : start + chunk])
        deltas.append(step.text_delta)
        if step.stop_str is not None:
            return deltas, step.stop_str, det
    deltas.append(det.finish())
    return deltas, None, det


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_stream_equals_full_decode(byte_tok, text: str, chunk: int) -> None:
    ids = encode(byte_tok, text)
    assert len(ids) == len(text.encode())
    deltas, stop, det = stream(byte_tok, ids, chunk=chunk)
    assert "".join(deltas) == text == byte_tok.decode(ids) == det.text
    assert stop is None
    assert not any("\ufffd" in d for d in deltas)


def test_partial_character_is_held_until_complete(byte_tok) -> None:
    ids = encode(byte_tok, "a中")  # 'a' + three bytes
    det = IncrementalDetokenizer(byte_tok, [], SamplingParams())
    assert [det.append([i]).text_delta for i in ids] == ["a", "", "", "中"]
    # A four-token ZWJ sequence arrives code point by code point, never as broken bytes.
    det = IncrementalDetokenizer(byte_tok, [], SamplingParams())
    deltas = [det.append([i]).text_delta for i in encode(byte_tok, "👨\u200d👩")]
    assert [d for d in deltas if d] == ["👨", "\u200d", "👩"]


@pytest.mark.parametrize("text", TEXTS)
def test_bpe_with_merges_stream_equals_full_decode(bpe_tok, text: str) -> None:
    ids = encode(bpe_tok, text)
    assert len(ids) < len(text.encode())  # merges happened
    for chunk in (1, 2, 5):
        deltas, _, _ = stream(bpe_tok, ids, chunk=chunk, prompt=encode(bpe_tok, "prefix 中"))
        assert "".join(deltas) == bpe_tok.decode(ids)
        assert not any("\ufffd" in d for d in deltas)


def test_merges_split_characters_in_this_tokenizer(bpe_tok) -> None:
    # Guards the test above: some token must hold an incomplete UTF-8 sequence.
    pieces = [bpe_tok.decode([i]) for text in TEXTS for i in encode(bpe_tok, text)]
    assert any("\ufffd" in p for p in pieces)


def test_prompt_context_keeps_leading_space(metaspace_tok) -> None:
    prompt, output = encode(metaspace_tok, "hello"), encode(metaspace_tok, "world fox")
    assert metaspace_tok.decode(output[:1]) == "world"
    deltas, _, _ = stream(metaspace_tok, output, prompt=prompt)
    assert "".join(deltas) == " world fox"
    full = metaspace_tok.decode(prompt + output)
    assert "".join(deltas) == full[len(metaspace_tok.decode(prompt)) :]


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_byte_fallback_tokenizer_with_prompt_context(llama_tok, chunk: int) -> None:
    prompt = encode(llama_tok, "hi")
    full = encode(llama_tok, "hi 中 ok é 👍")
    output = full[len(prompt) :]
    assert llama_tok.decode(output[:2]) == "\ufffd"  # the first byte of 中 alone
    deltas, _, _ = stream(llama_tok, output, chunk=chunk, prompt=prompt)
    assert "".join(deltas) == " 中 ok é 👍" == llama_tok.decode(full)[len("hi") :]
    assert not any("\ufffd" in d for d in deltas)


def test_without_prompt_first_word_has_no_leading_space(metaspace_tok) -> None:
    output = encode(metaspace_tok, "world fox")
    deltas, _, _ = stream(metaspace_tok, output)
    assert "".join(deltas) == "world fox"


def test_skip_special_tokens(byte_tok) -> None:
    eos = byte_tok.eos_token_id
    ids = encode(byte_tok, "hi") + [eos]
    assert "".join(stream(byte_tok, ids)[0]) == "hi"
    assert "".join(stream(byte_tok, ids, skip_special_tokens=False)[0]) == "hi</s>"


def test_stop_string_spanning_tokens_never_leaks(byte_tok) -> None:
    ids = encode(byte_tok, "hello world, bye")
    deltas, stop, det = stream(byte_tok, ids, stop=["world"])
    assert stop == "world" and det.stop_str == "world" and det.finished
    assert deltas == ["h", "e", "l", "l", "o", " ", "", "", "", "", ""]
    assert det.text == "hello "


def test_include_stop_str_in_output(byte_tok) -> None:
    ids = encode(byte_tok, "hello world, bye")
    deltas, stop, det = stream(byte_tok, ids, stop="world", include_stop_str_in_output=True)
    assert stop == "world"
    assert deltas[-1] == "world"
    assert "".join(deltas) == det.text == "hello world"


def test_multibyte_stop_string(byte_tok) -> None:
    ids = encode(byte_tok, "ab中文cd")
    for chunk in (1, 2, 4):
        deltas, stop, det = stream(byte_tok, ids, chunk=chunk, stop=["中文"])
        assert (stop, det.text) == ("中文", "ab")


def test_stop_string_at_the_very_start(byte_tok) -> None:
    deltas, stop, det = stream(byte_tok, encode(byte_tok, "hello"), stop=["he"])
    assert (deltas, stop, det.text) == (["", ""], "he", "")


def test_earliest_completed_stop_wins(byte_tok) -> None:
    ids = encode(byte_tok, "hello world bye")
    assert stream(byte_tok, ids, stop=["bye", "o w"])[2].text == "hell"
    # "b" completes before "abc" does, whether the text comes per token or all at once.
    for chunk in (1, 3):
        deltas, stop, det = stream(
            byte_tok, encode(byte_tok, "xabc"), chunk=chunk, stop=["abc", "b"]
        )
        assert (stop, det.text) == ("b", "xa")
    # Two stops completing at the same character: the longer one, as it starts earlier.
    _, stop, det = stream(byte_tok, encode(byte_tok, "xabc"), stop=["bc", "abc"])
    assert (stop, det.text) == ("abc", "x")


def test_possible_stop_prefix_is_released_when_ruled_out(byte_tok) -> None:
    deltas, stop, det = stream(byte_tok, encode(byte_tok, "abcab"), stop=["abx"])
    assert deltas == ["", "", "abc", "", "", "ab"]  # the last one comes from finish()
    assert stop is None and det.text == "abcab"


def test_finish_flushes_incomplete_utf8_as_replacement(byte_tok) -> None:
    ids = encode(byte_tok, "ok中")[:-1]
    det = IncrementalDetokenizer(byte_tok, [], SamplingParams())
    assert "".join(det.append([i]).text_delta for i in ids) == "ok"
    tail = det.finish()
    assert det.text == byte_tok.decode(ids) and tail == det.text[2:] and "\ufffd" in tail
    assert det.finish() == ""


def test_finish_still_cuts_a_stop_completed_by_the_flushed_tail(byte_tok) -> None:
    ids = encode(byte_tok, "ab中")[:-1]
    det = IncrementalDetokenizer(byte_tok, [], SamplingParams(stop=["b\ufffd"]))
    assert "".join(det.append([i]).text_delta for i in ids) == "a"
    assert det.finish() == "" and det.stop_str == "b\ufffd" and det.text == "a"


def test_append_after_stop_raises(byte_tok) -> None:
    _, _, det = stream(byte_tok, encode(byte_tok, "stop"), stop=["op"])
    with pytest.raises(RuntimeError, match="finished"):
        det.append([1])


def test_empty_append_is_a_no_op(byte_tok) -> None:
    det = IncrementalDetokenizer(byte_tok, [], SamplingParams())
    step = det.append([])
    assert (step.text_delta, step.stop_str, det.text) == ("", None, "")


def reference_cut(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The stop that completes first (longest among those ending together), by brute force."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return (text[:end] if include else text[: end - len(s)]), s
    return text, None


def test_random_streams_match_reference(byte_tok, bpe_tok) -> None:
    rng = random.Random(0)
    alphabet = list("ab ,中é👍") + ["\u200d"]
    for trial in range(150):
        tok = byte_tok if trial % 2 else bpe_tok
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(2)]
        include = rng.random() < 0.5
        ids = encode(tok, text)
        deltas, stop, det = stream(
            tok, ids, chunk=rng.randint(1, 4), stop=stops, include_stop_str_in_output=include
        )
        expected_text, expected_stop = reference_cut(tok.decode(ids), stops, include)
        # Deltas only ever extend the final text, so no part of a cut stop string leaked.
        assert ("".join(deltas), stop) == (expected_text, expected_stop), (text, stops)
        assert det.text == expected_text
        assert not any("\ufffd" in d for d in deltas)


def test_decoding_window_stays_bounded(byte_tok) -> None:
    longest: list[int] = []
    decode = byte_tok.decode

    def spy(ids, **kwargs):
        longest.append(len(ids))
        return decode(ids, **kwargs)

    det = IncrementalDetokenizer(byte_tok, encode(byte_tok, "prompt text"), SamplingParams())
    byte_tok.decode = spy
    try:
        for i in encode(byte_tok, "中文 " * 200):
            det.append([i])
    finally:
        del byte_tok.decode
    assert det.text == "中文 " * 200
    assert max(longest) <= 5 + 4

"""Builds the demo model's byte-level tokenizer.

Token id b (0..255) is the byte b, so any UTF-8 text round-trips losslessly and a multi-byte
character becomes several tokens (the engine's incremental detokenizer is tested on exactly that).
The special tokens follow at ids 256.. in the order of task.SPECIAL_TOKENS. There are no merges and
no unknown token. Called by train.py, which saves the result next to the weights.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel
from transformers import PreTrainedTokenizerFast

from tandem.engine.demo.task import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    SYSTEM_TOKEN,
    USER_TOKEN,
)

NUM_BYTES = 256
VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)

# Renders the conversation exactly as task.raw_prompt() does for one user message. System messages
# are kept (the model ignores them well enough, and dropping text silently would surprise users).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '" + SYSTEM_TOKEN + "' + message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '" + USER_TOKEN + "' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '" + ASSISTANT_TOKEN + "' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + ASSISTANT_TOKEN + "' }}{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A new byte-level PreTrainedTokenizerFast with the demo's special tokens and chat template.

    The caller owns the result; save it with `save_pretrained(dir)`.
    """
    byte_to_char = ByteLevel.alphabet()
    # ByteLevel.alphabet() is unordered; rebuild GPT-2's byte->char map so that id == byte value.
    vocab = {_byte_char(b): b for b in range(NUM_BYTES)}
    if set(vocab) != set(byte_to_char):
        raise RuntimeError("byte-level alphabet mismatch between tokenizers and the GPT-2 map")
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=256,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    if ids != list(range(NUM_BYTES, VOCAB_SIZE)):
        raise RuntimeError(f"special token ids are {ids}, expected 256..{VOCAB_SIZE - 1}")
    return tokenizer


def _byte_char(b: int) -> str:
    """GPT-2's reversible byte -> printable character map (the one ByteLevel uses)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    if b in printable:
        return chr(b)
    return chr(NUM_BYTES + sum(1 for x in range(b) if x not in printable))

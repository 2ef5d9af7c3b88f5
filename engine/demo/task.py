"""The demo model's task: reverse a short string of lowercase letters and digits.

Pure functions shared by the training script and by tests everywhere (engine, router, end to end),
so that any component can build a prompt and check that the model's answer is exactly right.
"""

from __future__ import annotations

import random
import string

ALPHABET = string.ascii_lowercase + string.digits
MIN_LEN = 1
MAX_LEN = 10
INSTRUCTION = "reverse: "

# Special tokens of the demo tokenizer; the chat template and raw_prompt() must agree on them.
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|end|>"
PAD_TOKEN = "<|pad|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)

# Seed of the held-out inputs, on which tests score the model. Training never sees those of length
# >= HELD_OUT_MIN_LEN; shorter strings (1,332 in all) are a space it is meant to cover completely.
HELD_OUT_SEED = 1234
NUM_HELD_OUT = 200
HELD_OUT_MIN_LEN = 3


def validate_input(s: str) -> None:
    """Raise ValueError unless `s` is a valid task input (1..MAX_LEN chars from ALPHABET)."""
    if not isinstance(s, str):
        raise ValueError(f"task input must be a str, got {type(s).__name__}")
    if not MIN_LEN <= len(s) <= MAX_LEN:
        raise ValueError(f"task input length must be in [{MIN_LEN}, {MAX_LEN}], got {len(s)}")
    bad = sorted(set(s) - set(ALPHABET))
    if bad:
        raise ValueError(f"task input has characters outside [a-z0-9]: {bad!r}")


def make_user_message(s: str) -> str:
    """The user message that asks the model to reverse `s`, e.g. "reverse: abc"."""
    validate_input(s)
    return INSTRUCTION + s


def expected_answer(s: str) -> str:
    """The exact answer text the model must generate (before its EOS token)."""
    validate_input(s)
    return s[::-1]


def raw_prompt(s: str) -> str:
    """The exact text the chat template renders for one user message with a generation prompt.

    Tokenizing it (special tokens are matched in the text) gives the same ids as
    `tokenizer.apply_chat_template([{"role": "user", ...}], add_generation_prompt=True)`.
    """
    return BOS_TOKEN + USER_TOKEN + make_user_message(s) + ASSISTANT_TOKEN


def random_input(rng: random.Random, min_len: int = MIN_LEN, max_len: int = MAX_LEN) -> str:
    """One input: length uniform in [min_len, max_len], characters uniform over ALPHABET."""
    if not MIN_LEN <= min_len <= max_len <= MAX_LEN:
        raise ValueError(f"need {MIN_LEN} <= min_len <= max_len <= {MAX_LEN}")
    length = rng.randint(min_len, max_len)
    return "".join(rng.choice(ALPHABET) for _ in range(length))


def sample_inputs(n: int, seed: int, min_len: int = MIN_LEN, max_len: int = MAX_LEN) -> list[str]:
    """`n` task inputs, deterministic for `seed` (same list on every machine and Python run)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    return [random_input(rng, min_len, max_len) for _ in range(n)]


def held_out_inputs(n: int = NUM_HELD_OUT) -> list[str]:
    """The first `n` held-out inputs (training excludes those of length >= HELD_OUT_MIN_LEN)."""
    if not 0 <= n <= NUM_HELD_OUT:
        raise ValueError(f"n must be in [0, {NUM_HELD_OUT}], got {n}")
    return sample_inputs(NUM_HELD_OUT, HELD_OUT_SEED)[:n]

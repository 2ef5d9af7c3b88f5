"""The bundled demo model: a tiny Llama trained to reverse short strings (DESIGN.md section 4).

`weights_path()` gives the Hugging Face directory that `model="demo"` loads; the task helpers let
any test build a prompt and check the model's answer exactly.
"""

from __future__ import annotations

from pathlib import Path

from tandem.engine.demo.task import (
    ALPHABET,
    EOS_TOKEN,
    MAX_LEN,
    MIN_LEN,
    expected_answer,
    held_out_inputs,
    make_user_message,
    raw_prompt,
    sample_inputs,
)

__all__ = [
    "ALPHABET",
    "EOS_TOKEN",
    "MAX_LEN",
    "MIN_LEN",
    "DemoWeightsMissingError",
    "expected_answer",
    "held_out_inputs",
    "make_user_message",
    "raw_prompt",
    "sample_inputs",
    "weights_path",
]

_WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class DemoWeightsMissingError(FileNotFoundError):
    """The bundled demo weights are absent or incomplete (e.g. an install without package data)."""


def weights_path() -> Path:
    """The directory of the bundled demo model (standard HF layout), checked to be complete.

    Raises DemoWeightsMissingError naming the missing files and how to regenerate them.
    """
    missing = [name for name in _REQUIRED_FILES if not (_WEIGHTS_DIR / name).is_file()]
    if missing:
        raise DemoWeightsMissingError(
            f"demo model weights missing in {_WEIGHTS_DIR}: {', '.join(missing)}; "
            "regenerate them with `python -m tandem.engine.demo.train`"
        )
    return _WEIGHTS_DIR

"""Prompt encoding at the router: chat template and tokenization, once per request.

Loaded once by the app's lifespan from the model directory with ``AutoTokenizer.from_pretrained``
(local files only; nothing is downloaded). Also turns token ids into strings for logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandem.router.errors import bad_request


class PromptEncoder:
    """Wraps a Hugging Face tokenizer; thread-safe for reads, so handlers share one."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._vocab_size = len(tokenizer)  # len() walks the added vocabulary: cache it

    @classmethod
    def load(cls, model_path: Path) -> PromptEncoder:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(model_path), local_files_only=True))

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer (the flow's detokenizers decode with it)."""
        return self._tok

    def encode_text(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def encode_chat(
        self,
        messages: Sequence[dict[str, str]],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
    ) -> list[int]:
        """Render the model's chat template and tokenize it (the template carries any BOS)."""
        if getattr(self._tok, "chat_template", None) is None:
            raise bad_request("This model has no chat template; use /v1/completions.", "messages")
        try:
            text = self._tok.apply_chat_template(
                list(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(template_kwargs or {}),
            )
        except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
            raise bad_request(
                f"The chat template failed on these messages: {exc}", "messages"
            ) from None
        return list(self._tok.encode(text, add_special_tokens=False))

    def vocab_size(self) -> int:
        return self._vocab_size

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (byte-level BPE maps bytes to printable characters)."""
        piece = self._tok.convert_ids_to_tokens(token_id)
        decoder = getattr(self._tok, "byte_decoder", None) or _BYTE_DECODER
        if isinstance(piece, str) and all(ch in decoder for ch in piece):
            return [decoder[ch] for ch in piece]
        return list(self.token_text(token_id).encode())


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte <-> printable-character map used by byte-level tokenizers."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


_BYTE_DECODER = {ch: b for b, ch in _bytes_to_unicode().items()}

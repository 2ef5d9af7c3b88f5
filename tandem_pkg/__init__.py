"""Tandem: disaggregated prefill/decode LLM serving. Offline API: ``from tandem import LLM``."""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["LLM", "SamplingParams", "RequestOutput"]

if TYPE_CHECKING:
    from tandem.engine.llm import LLM, RequestOutput
    from tandem.engine.sampling_params import SamplingParams


def __getattr__(name: str):  # lazy: the CLI must not pay for torch when it only runs the operator
    if name in ("LLM", "RequestOutput"):
        from tandem.engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from tandem.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)

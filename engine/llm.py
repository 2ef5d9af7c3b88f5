"""The offline API: ``LLM(model="demo").generate(prompts, params)``.

The engine's step streams token ids; ``generate`` makes the text between steps with one
``SequenceOutput`` per sequence (the router's output processing, ``output_processor.py``) and
aborts a sequence in the engine when one of its stop strings matches.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields
from typing import Any

from tandem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.engine import Engine
from tandem.engine.output_processor import SequenceOutput
from tandem.engine.sampler import TokenLogprobs
from tandem.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def build_engine_config(model: str, **options: Any) -> EngineConfig:
    """Split flat keyword options (vLLM style) into the narrow configs; unknown ones are errors."""
    groups: dict[type, dict[str, Any]] = {SchedulerConfig: {}, CacheConfig: {}, EngineConfig: {}}
    names = {cls: {f.name for f in fields(cls)} for cls in groups}
    for key, value in options.items():
        for cls in (SchedulerConfig, CacheConfig, EngineConfig):
            if key in names[cls] and key not in ("scheduler", "cache"):
                groups[cls][key] = value
                break
        else:
            raise ValueError(f"unknown engine option {key!r}")
    if "max_model_len" in groups[SchedulerConfig]:
        groups[EngineConfig]["max_model_len"] = groups[SchedulerConfig]["max_model_len"]
    return EngineConfig(
        model=model,
        scheduler=SchedulerConfig(**groups[SchedulerConfig]),
        cache=CacheConfig(**groups[CacheConfig]),
        **groups[EngineConfig],
    )


class LLM:
    """Synchronous batch generation over the Engine; options are EngineConfig/SchedulerConfig/
    CacheConfig field names (e.g. ``max_num_batched_tokens=64, num_blocks=128``)."""

    def __init__(self, model: str = "demo", **options: Any) -> None:
        self.engine = Engine(build_engine_config(model, **options))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        Raises ValueError for an invalid prompt or parameter before anything is queued.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("params must be one SamplingParams or one per prompt")
        batches = []
        for prompt, p in zip(prompts, plist, strict=True):
            batches.append(self.engine.make_requests(f"offline-{next(self._ids)}", prompt, p))
        results: dict[str, RequestOutput] = {}
        texts: dict[str, SequenceOutput[TokenLogprobs]] = {}
        order = []
        for reqs in batches:
            gid = reqs[0].group_id
            order.append(gid)
            results[gid] = RequestOutput(
                gid, list(reqs[0].prompt_token_ids), [CompletionOutput(i) for i in range(len(reqs))]
            )
            for req in reqs:
                self.engine.enqueue(req)
                texts[req.request_id] = SequenceOutput.create(
                    self.engine.tokenizer, req.prompt_token_ids, req.params
                )
        while self.engine.has_unfinished:
            for out in self.engine.step():
                seq = texts[out.request_id]
                if seq.finished:
                    continue  # ended by a stop string; its abort is on the way
                res = results[out.group_id]
                comp = res.outputs[out.index]
                delta = seq.process(
                    out.new_token_ids, out.logprobs, out.finish_reason, out.stop_reason
                )
                comp.token_ids.extend(delta.token_ids)
                comp.text += delta.text
                comp.logprobs.extend(delta.logprobs)
                if delta.stopped_by_string and not out.finished:
                    self.engine.abort([out.request_id])
                if out.finished or delta.stopped_by_string:
                    comp.finish_reason = delta.finish_reason or out.finish_reason
                    comp.stop_reason = delta.stop_reason if delta.finish_reason else out.stop_reason
                    if out.index == 0:
                        res.num_cached_tokens = out.num_cached_tokens
        return [results[g] for g in order]

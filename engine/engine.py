"""Engine: the step loop tying Scheduler, ModelRunner and the role hooks together.

Its outputs are token ids: text and stop strings are made where output leaves the system
(``output_processor.py``: the router, the offline ``LLM``), as in vLLM v1.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from operator import attrgetter, itemgetter

import torch

from tandem.engine.builder import EngineParts, build_engine_parts
from tandem.engine.config import EngineConfig
from tandem.engine.hashing import BlockHash
from tandem.engine.hooks import ColocatedHooks, RoleHooks
from tandem.engine.kv_cache_manager import cdiv
from tandem.engine.kv_events import KVEvent
from tandem.engine.outputs import (
    EngineOutput,
    EngineStats,
    HostTierStats,
    SchedulerOutput,
    StepOutputs,
    request_outputs,
)
from tandem.engine.recovery import (
    Accounting,
    EngineFailed,
    accounting,
    check_engine_integrity,
    contain,
)
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampler import TokenLogprobs
from tandem.engine.sampling_params import SamplingParams

__all__ = ["Engine", "EngineFailed", "EngineOutput", "EngineStats"]

log = logging.getLogger(__name__)

# A failure that repeats step after step (whatever requests run) is the engine's, not theirs.
MAX_CONSECUTIVE_FAILED_STEPS = 5


class Engine:
    """Single-threaded: add_request / step / abort are called from one thread (the offline LLM
    loop or a worker's engine thread). Blocks belong to the scheduler's KVCacheManager.

    ``hooks`` are the worker role's policy (prefill hand-off, decode KV loads); the default is
    colocated. Built from an ``EngineConfig``, or from ``EngineParts`` a worker already built.
    """

    def __init__(self, config: EngineConfig | EngineParts, hooks: RoleHooks | None = None) -> None:
        parts = config if isinstance(config, EngineParts) else build_engine_parts(config)
        self.config = parts.config
        self.model_path = parts.model_path
        self.hf_config = parts.hf_config
        self.arch = parts.arch
        self.tokenizer = parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.max_model_len = parts.max_model_len
        self.layout = parts.layout
        self.pool = parts.pool
        self.kv = parts.kv
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.copier = parts.copier
        self.hooks: RoleHooks = hooks or ColocatedHooks()
        self._requests: dict[str, Request] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        # Wall seconds of the steps that ran the model, from the step's start to the
        # scheduler's update (the worker's ``tandem_worker_busy_seconds_total``): against a
        # profile's predicted step times it says how fast the machine ran meanwhile.
        self.busy_seconds = 0.0
        self._failed_steps = 0

    # ---- requests -----------------------------------------------------------------------------
    def make_requests(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> list[Request]:
        """Validate and build the n requests of one prompt; nothing is queued yet.

        Raises ValueError naming the offending field; the engine's state is unchanged.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        params.validate()
        token_ids = self.encode_prompt(prompt)
        ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        if any(self._holds(rid) for rid in {request_id, *ids}):
            raise ValueError(f"request_id {request_id!r} is already in use")
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        out = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}-{i}"
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.runner.device).manual_seed(params.seed + i)
            out.append(
                Request(
                    rid,
                    list(token_ids),
                    params,
                    eos_token_ids=self.eos_token_ids,
                    block_size=self.layout.block_size,
                    priority=priority,
                    arrival_time=arrival,
                    generator=gen,
                    group_id=request_id,
                    group_index=i,
                    max_tokens=max_tokens,
                )
            )
        return out

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            token_ids = list(prompt)
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.arch.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of range [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                "(the prompt and at least one generated token must fit)"
            )
        return token_ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> list[Request]:
        reqs = self.make_requests(request_id, prompt, params, priority, arrival_time)
        for req in reqs:
            self.enqueue(req)
        return reqs

    def enqueue(self, req: Request) -> None:
        """Queue a built request, after the role's ``on_admit`` accepted it (ValueError: nothing
        is queued)."""
        self.hooks.on_admit(req)
        self._requests[req.request_id] = req
        self.scheduler.add_request(req)

    def pin_prefix(self, request_id: str, token_ids: list[int]) -> list[int]:
        """A peer asks for this worker's cached blocks of the prompt prefix ``token_ids`` (whole
        blocks): the leading ones cached here are pinned under ``request_id`` (a pinned request,
        as for a decode worker) until the role releases it; returns their block ids ([]: none
        cached, nothing pinned). ValueError for an id in use or a prefix of partial blocks."""
        bs = self.layout.block_size
        if not token_ids or len(token_ids) % bs:
            raise ValueError(f"the prefix must be a non-empty multiple of {bs} tokens")
        if self._holds(request_id):
            raise ValueError(f"request {request_id!r} is already in use here")
        (req,) = self.make_requests(request_id, token_ids, SamplingParams(max_tokens=1))
        req.remote_decode = True  # an abort tells the connector, as for a hand-off
        if self.scheduler.pin_prefix(req) == 0:
            return []
        return list(req.block_ids)

    def _holds(self, request_id: str) -> bool:
        """A request of this id may still hold blocks here: tracked (running, waiting, loading
        or handing off), still loading after an abort, or pinned for a decode worker."""
        s = self.scheduler
        if request_id in self._requests or request_id in s.loading or request_id in s.pinned:
            return True
        return any(r.group_id == request_id for r in self._requests.values())

    def abort(self, request_ids: list[str]) -> list[EngineOutput]:
        """Abort by request id or group id (n > 1). Blocks return to the pool once nothing may
        read or write them: at once for running and waiting requests; a loading request's when
        its pull ended; a pinned request's when the connector releases them (never while a
        transfer reads them)."""
        wanted = set(request_ids)
        found = [r for r in self._requests.values()
                 if r.request_id in wanted or r.group_id in wanted]  # fmt: skip
        pinned = [self.scheduler.pinned[rid] for rid in wanted & self.scheduler.pinned.keys()]
        for req in [*found, *pinned]:
            self.hooks.on_abort(req)
        done = self.scheduler.finish_requests(
            [r.request_id for r in found], RequestStatus.FINISHED_ABORTED
        )
        for req in pinned:
            req.status = RequestStatus.FINISHED_ABORTED  # stays pinned until released
        return [self._final(r) for r in [*done, *pinned]]

    def fail(self, reqs: list[Request], message: str) -> list[EngineOutput]:
        """End ``reqs`` with an error (failure containment, ``recovery.py``); returns the final
        outputs still due. Pinned requests already handed off stay pinned until released."""
        for req in reqs:
            try:
                self.hooks.on_abort(req)
            except Exception:  # noqa: BLE001 - the reset must go on; the lease expires anyway
                log.exception("role hook failed while failing %s", req.request_id)
        pinned = self.scheduler.pinned
        handed_off = [r for r in reqs if r.request_id in pinned and not self._tracked(r)]
        ids = [r.request_id for r in reqs if r not in handed_off]
        done = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        # Ended in this step before its output failed: no queue holds it (its blocks are
        # free), but its stream still owes the final output.
        gone = set(map(id, done))
        done += [r for r in reqs if r.is_finished and id(r) not in gone and r not in handed_off
                 and self._tracked(r)]  # fmt: skip
        for req in done:
            req.status = RequestStatus.FINISHED_ERROR  # a pinned culprit too
            req.error = message
        for req in handed_off:
            req.status = RequestStatus.FINISHED_ERROR
        return [self._final(r) for r in done if self._tracked(r)]

    def _tracked(self, req: Request) -> bool:
        return self._requests.get(req.request_id) is req

    def all_requests(self) -> list[Request]:
        """Every request the engine holds in any state (failure containment resets them all)."""
        s = self.scheduler
        reqs = {id(r): r for r in self._requests.values()}
        for r in [*s.running, *s.waiting, *s.loading.values(), *s.pinned.values()]:
            reqs.setdefault(id(r), r)
        return list(reqs.values())

    @property
    def num_tracked(self) -> int:
        return len(self._requests)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> Sequence[EngineOutput]:
        """One step. A phase that raises is contained (``recovery.contain``): the requests it is
        attributed to end with an error and the engine keeps serving; EngineFailed when its
        state cannot be restored. A steady decode step's outputs are a ``StepOutputs`` (made
        when read); the rest a list."""
        started = time.perf_counter()
        outputs: list[EngineOutput] = []
        ran: SchedulerOutput | None = None  # None: a failure is not attributable
        try:
            sched = self.scheduler
            outputs += self._finals(self.hooks.before_step(sched))
            outputs += self._finals(self._finish_host_loads())
            out = sched.schedule()
            if self.copier is not None and self.kv.tier is not None:
                # Before the connector or the forward pass may write blocks this step reused.
                self.copier.submit(self.kv.tier.take_ops())
                if out.loads:
                    self.copier.wait_offloads()
            outputs += self._finals(self.hooks.on_scheduled(sched, out))
            changed: list[Request] = []
            if not out.is_empty:
                ran = out  # a failure from here on is the scheduled requests'
                result = self.runner.execute(out)
                self.num_prompt_tokens += out.num_prompt_tokens
                changed = sched.update(out, result)
                self.busy_seconds += time.perf_counter() - started
        except Exception as exc:  # noqa: BLE001 - contained; EngineFailed escapes
            self._failed_steps += 1
            if self._failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
                raise EngineFailed(f"{self._failed_steps} steps in a row failed: {exc!r}") from exc
            victims = None if ran is None else [s.request for s in ran.scheduled]
            return outputs + contain(self, exc, victims)
        self._failed_steps = 0
        if changed:
            if not outputs and max(map(_status, changed)) < RequestStatus.FINISHED_STOPPED:
                # The common step: nothing ended, so nothing retires; the outputs are made by
                # whoever reads them (StepOutputs), from a snapshot of the new tokens.
                self.num_generation_tokens += len(changed)
                tokens = list(map(_last, map(_output_ids, changed)))
                return StepOutputs(changed, tokens, result.logprobs)
            outputs += self._step_outputs(changed, result.logprobs)
        return outputs

    def _finish_host_loads(self) -> list[Request]:
        if self.copier is None:
            return []
        ended = []
        for res in self.copier.poll():
            req = self.scheduler.finish_host_load(res.request_id, res.bad_host_blocks)
            if req is not None:
                ended.append(req)
        return ended

    def _finals(self, ended: list[Request]) -> list[EngineOutput]:
        return [self._final(r) for r in ended if r.request_id in self._requests]

    def _step_outputs(
        self, changed: list[Request], logprobs: dict[str, TokenLogprobs | None]
    ) -> list[EngineOutput]:
        """The outputs of the requests that produced a token this step, built in one pass (if
        that fails, request by request); each finished one retires. A request whose output
        fails is contained alone."""
        try:
            outs: list[EngineOutput] | None = request_outputs(changed, logprobs)
        except Exception:  # noqa: BLE001 - found and contained request by request below
            outs = None
        if outs is not None and not any(map(_finished, outs)):
            self.num_generation_tokens += len(outs)
            return outs  # the common step: nothing ended
        kept: list[EngineOutput] = []
        for i, req in enumerate(changed):
            self.num_generation_tokens += 1
            try:
                out = outs[i] if outs is not None else request_outputs([req], logprobs)[0]
                if out.finished:
                    if req.status == RequestStatus.FINISHED_REMOTE_DECODE:
                        self.hooks.on_handoff(req, out)
                    self._forget(req)
            except Exception as exc:  # noqa: BLE001 - attributable to this request alone
                kept += contain(self, exc, [req])
                continue
            kept.append(out)
        return kept

    def _final(self, req: Request) -> EngineOutput:
        self._forget(req)
        (out,) = request_outputs([req], {}, new_token=False)
        return out

    def _forget(self, req: Request) -> None:
        self._requests.pop(req.request_id, None)

    # ---- observability ------------------------------------------------------------------------
    def take_kv_events(self) -> list[KVEvent]:
        """The device pool's events, then the host tier's (each tier's set changes apart)."""
        events = self.pool.take_events()
        if self.kv.tier is not None:
            events.extend(self.kv.tier.host.take_events())
        return events

    def cached_host_hashes(self) -> list[BlockHash]:
        """Hashes the host tier holds (the KV-event snapshot's host part); [] without one."""
        return self.kv.tier.host.cached_hashes() if self.kv.tier is not None else []

    def stats(self) -> EngineStats:
        sched, tier, copier = self.scheduler, self.kv.tier, self.copier
        return EngineStats(
            num_running=len(sched.running) + len(sched.loading),
            num_waiting=len(sched.waiting),
            kv_usage=self.pool.usage,
            num_free_blocks=self.pool.num_free_blocks,
            prefix_queried_tokens=self.kv.queried_tokens,
            prefix_hit_tokens=self.kv.hit_tokens,
            num_preemptions=sched.num_preemptions,
            num_swap_preemptions=sched.num_swap_preemptions,
            host_tier=None if tier is None or copier is None else HostTierStats(
                num_blocks=tier.host.num_blocks,
                usage=tier.host.usage,
                hit_tokens=self.kv.host_hit_tokens,
                offloaded_blocks=tier.num_offloaded,
                loaded_blocks=tier.num_loaded,
                integrity_failures=tuple((r.value, n) for r, n in copier.failures.items()),
            ),
        )  # fmt: skip

    def check_integrity(self) -> None:
        """AssertionError unless the pools, block tables and queues agree (``recovery.py``)."""
        check_engine_integrity(self)

    def check_tier_integrity(self) -> None:
        """With a host tier: the scheduler's loading requests are exactly the connector's and
        the tier's loads, and every cached host block is tagged with its hash in the copier."""
        tier = self.kv.tier
        if tier is None or self.copier is None:
            return
        loading = self.scheduler.loading
        waiting = {r for r, q in loading.items() if q.status == RequestStatus.WAITING_FOR_HOST_KV}
        if not waiting <= tier.loading_ids <= loading.keys():
            raise AssertionError("the scheduler's host loads disagree with the host tier's")
        tags = self.copier.tags
        for block in tier.host.blocks:
            if block.block_hash is not None and tags[block.block_id] != block.block_hash:
                raise AssertionError(f"host block {block.block_id} is not tagged with its hash")

    def accounting(self) -> Accounting:
        return accounting(self)

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.layout.block_size)


_finished = attrgetter("finished")
_status = attrgetter("status")
_output_ids = attrgetter("output_token_ids")
_last = itemgetter(-1)

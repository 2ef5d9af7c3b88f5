"""Scheduler: which requests run in the next step, and how many tokens each computes.

One policy for every role, in the manner of vLLM v1: each request simply has
``num_computed_tokens`` catch up with ``num_tokens`` under a per-step token budget, so chunked
prefill, prefix-cache hits, decodes and recompute after preemption are the same code path.
Roles differ only at the edges, and the scheduler offers them two generic mechanisms, keyed by
request fields the role sets (``tandem.prefill`` / ``tandem.decode`` own the policy):

- hand-off: a request marked ``remote_decode`` ends after its first token
  (FINISHED_REMOTE_DECODE) and its blocks stay ``pinned`` until ``release_pinned``;
- external KV: a request carrying ``kv_transfer_params`` is admitted with blocks for the prompt
  part the local prefix cache lacks, waits in ``loading`` while the role fills them (a
  ``LoadSpec`` in the step's output), and runs once ``finish_load`` says they are whole. The
  params name the whole prompt (decode after a prefill worker) or a cached prefix of it held by
  a peer (``pin_prefix`` there); after a prefix the request computes the rest here.

With a host KV tier (``KVCacheManager.tier``) the core uses the same ``loading`` state itself:
a prefix match that continues into the tier, or a swapped-out request resuming, waits there
(WAITING_FOR_HOST_KV) while the engine's ``TierCopier`` loads its blocks, and runs once
``finish_host_load`` says they are whole. Preemption swaps when the tier has room.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from tandem.engine.block_pool import KVCacheBlock
from tandem.engine.config import SchedulerConfig
from tandem.engine.kv_cache_manager import KVCacheManager, cdiv
from tandem.engine.outputs import LoadSpec, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tandem.engine.request import Request, RequestStatus


class Scheduler:
    """Owned and called by the Engine, on the engine thread: schedule(), run the model, update()."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # Decode role: requests whose blocks are allocated and being filled by the KV connector.
        self.loading: dict[str, Request] = {}
        # Prefill role: finished requests whose blocks stay pinned until a decode worker pulls them.
        self.pinned: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self._leaders: dict[str, Request] = {}
        self._sorted: list[Request] = []  # ``running`` as schedule() last sorted it
        # Each running request's decode row (1 token, sampled), reused step after step: rows
        # are never mutated, and building 256 of them was a tenth of the engine thread's time.
        self.decode_rows: dict[str, ScheduledRequest] = {}

    # ---- queues -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        if request.group_index == 0:
            self._leaders[request.group_id] = request

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading)

    def _key(self, r: Request) -> tuple[int, float]:
        return (r.priority - r.waited_steps // self.config.aging_steps, r.arrival_time)

    # ---- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        running = self.running
        # A running request's key never changes (only waiting ones age), so a list still in the
        # order it was last sorted into needs no sort (one C-level identity compare).
        if running != self._sorted:
            running.sort(key=self._key)
            self._sorted = running.copy()
        bs = self.kv.block_size
        append = out.scheduled.append
        decode_rows = self.decode_rows
        prompt_tokens = 0
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            left = len(req.all_token_ids) - computed
            if left <= 0:
                i += 1
                continue
            num_new = left if left <= budget else budget
            # Most decode steps fit in the blocks already held (one is needed every bs tokens).
            if computed + num_new > len(req.block_ids) * bs:
                while not self.kv.allocate_slots(req, num_new):
                    victim = max(running[i:], key=self._key)
                    self._preempt(victim, out)
                    if victim is req:
                        break
                if req.status != RequestStatus.RUNNING:
                    continue  # req itself was preempted; running[i] is now the next request
            if computed < len(req.prompt_token_ids):
                prompt_tokens += min(num_new, len(req.prompt_token_ids) - computed)
            if num_new == 1 and left == 1:  # a decode: the request's row is the same each step
                row = decode_rows.get(req.request_id)
                if row is None or row.request is not req:
                    row = decode_rows[req.request_id] = ScheduledRequest(req, 1, True)
                append(row)
            else:
                append(ScheduledRequest(req, num_new, num_new == left))
            budget -= num_new
            i += 1
        out.num_prompt_tokens = prompt_tokens

        if not out.preempted:
            budget = self._admit_waiting(out, budget)
        for req in self.waiting:
            req.waited_steps += 1
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        self.waiting.sort(key=self._key)
        admitted: list[Request] = []
        for req in self.waiting:
            if len(self.running) + len(self.loading) >= self.config.max_num_seqs:
                break
            if self.kv.is_swapped(req):
                if not self.kv.resume_swapped(req, max(budget, 1)):
                    break
                self._wait_for_host(req)
                admitted.append(req)
                continue
            if req.kv_transfer_params is not None:
                if not self._admit_remote(req, out):
                    break
                admitted.append(req)
                continue
            if budget <= 0:
                break
            if not self._leader_ready(req):
                continue  # siblings of n > 1 wait for the shared prompt to be cached
            hits, num_hit = self.kv.get_computed_blocks(req)
            host_hits = self.kv.get_host_hits(req, len(hits))
            if host_hits:
                rest = req.num_tokens - num_hit - len(host_hits) * self.kv.block_size
                if not self.kv.load_from_host(req, hits, host_hits, min(rest, budget)):
                    break
                self._wait_for_host(req)
                admitted.append(req)
                continue
            num_new = req.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if not self.kv.allocate_slots(req, num_new, hits, num_hit):
                break  # FCFS: nobody jumps a request that does not fit
            req.num_computed_tokens = num_hit
            self.kv.record_prefix_query(req.num_tokens, num_hit)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.append(req)
            self._add_scheduled(out, req, num_new)
            budget -= num_new
        if admitted:
            now = time.monotonic()
            for req in admitted:
                if not req.first_scheduled_time:  # a preempted request keeps its first
                    req.first_scheduled_time = now
            taken = set(map(id, admitted))
            self.waiting = [r for r in self.waiting if id(r) not in taken]
        return budget

    def _admit_remote(self, req: Request, out: SchedulerOutput) -> bool:
        """Allocate blocks for the prompt part the local prefix cache lacks and ask for a pull.

        Two kinds of request carry ``kv_transfer_params``. A decode worker's holds the prefill's
        first token as output 0, so num_tokens = prompt + 1 and the prefix match can cover every
        full prompt block; the pull brings the whole prompt. A prefix pull from a peer
        (``params.num_tokens`` whole blocks, short of the prompt) brings only those blocks; once
        they are in, the request computes the rest of its prompt here. Either way the blocks of
        the whole prompt are allocated at admission.
        """
        hits, num_hit = self.kv.get_computed_blocks(req)
        prompt_len = req.num_prompt_tokens
        if not self.kv.allocate_slots(req, prompt_len - num_hit, hits, num_hit):
            return False
        first_missing = num_hit // self.kv.block_size
        remote = list(req.kv_transfer_params.block_ids)
        num_loaded_blocks = cdiv(req.kv_transfer_params.num_tokens, self.kv.block_size)
        req.num_computed_tokens = num_hit
        req.num_cached_tokens = num_hit
        self.kv.record_prefix_query(req.num_tokens, num_hit)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.loading[req.request_id] = req
        out.loads.append(
            LoadSpec(req, remote[first_missing:], req.block_ids[first_missing:num_loaded_blocks])
        )
        return True

    def finish_load(
        self, request_id: str, ok: bool, error: str | None, fail: bool = False
    ) -> Request | None:
        """The role finished (or gave up) filling this request's blocks (decode role).

        On failure the request recomputes its prompt locally, or, with ``fail``, ends with an
        error. Returns the request if it ended here (aborted before, or failed with ``fail``).
        """
        req = self.loading.pop(request_id, None)
        if req is None:
            return None
        if req.is_finished:  # aborted while the pull ran: only now may the blocks be reused
            self.kv.free(req)
            return req
        if ok:
            assert req.kv_transfer_params is not None
            # The whole prompt (decode), or a prefix the local cache may already have passed.
            loaded = req.kv_transfer_params.num_tokens
            req.num_computed_tokens = max(loaded, req.num_computed_tokens)
            self.kv.cache_blocks(req, req.num_computed_tokens)
            # The KV is local now: a later preemption recomputes it here, never pulls again
            # from a prefill that has released it.
            req.kv_transfer_params = None
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            return None
        self.kv.free(req)
        req.kv_transfer_params = None
        req.num_computed_tokens = 0
        if fail:
            req.status = RequestStatus.FINISHED_ERROR
            req.error = f"KV transfer from the prefill worker failed: {error}"
            return req
        req.status = RequestStatus.WAITING
        self.waiting.insert(0, req)
        return None

    def _wait_for_host(self, req: Request) -> None:
        req.status = RequestStatus.WAITING_FOR_HOST_KV
        self.loading[req.request_id] = req

    def finish_host_load(self, request_id: str, bad_host_blocks: tuple[int, ...]) -> Request | None:
        """The engine's copier finished a host-tier load (``bad_host_blocks`` failed a check).

        Whole: the request runs from the loaded prefix (or, swapped out, from where it stopped).
        Otherwise those host blocks are forgotten and the request re-queues in front, matching
        again only what is still sound. Returns the request if it ended here (aborted before).
        """
        load = self.kv.end_host_load(request_id, bad_host_blocks)
        req = self.loading.pop(request_id)
        if req.is_finished:  # aborted while the copies ran: only now may the blocks be reused
            self.kv.free(req)
            return req
        if bad_host_blocks:
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED if load.swap else RequestStatus.WAITING
            self.waiting.insert(0, req)
            return None
        req.num_computed_tokens = load.num_computed_tokens
        self.kv.cache_blocks(req, req.num_computed_tokens)
        if not load.swap:
            self.kv.record_prefix_query(req.num_tokens, load.num_computed_tokens)
            self.kv.host_hit_tokens += len(load.copies) * self.kv.block_size
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = load.num_computed_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return None

    def _leader_ready(self, req: Request) -> bool:
        if req.group_index == 0:
            return True
        leader = self._leaders.get(req.group_id)
        return leader is None or leader.prompt_done_once or leader.is_finished

    def _add_scheduled(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        computed = req.num_computed_tokens
        sample = computed + num_new == req.num_tokens
        out.scheduled.append(ScheduledRequest(req, num_new, sample))
        out.num_prompt_tokens += max(0, min(num_new, req.num_prompt_tokens - computed))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Swap the KV to the host tier if it has room, else drop it (recompute); either way the
        tokens stay and the request re-queues in front."""
        self.running.remove(req)
        if self.kv.swap_out(req):
            self.num_swap_preemptions += 1
        else:
            self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, req)
        out.preempted.append(req)

    # ---- results ------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance each scheduled request by its chunk; append sampled tokens; finish requests.

        Returns the requests that produced a token or finished this step.
        """
        changed: list[Request] = []
        add = changed.append
        finished: list[Request] = []
        kv = self.kv
        lagging = kv.lagging  # the set itself: its contents may change in the loop
        sampled = iter(result.sampled_token_ids)  # one per sampled row, in this order
        running_status = RequestStatus.RUNNING
        max_model_len = self.config.max_model_len
        bs = kv.block_size
        try:
            for s in out.scheduled:
                req = s.request
                if req.status is not running_status:  # ended after schedule() (a role hook)
                    if s.sample:
                        next(sampled)  # its token is dropped
                    continue
                num_new = s.num_new_tokens
                computed = req.num_computed_tokens + num_new
                req.num_computed_tokens = computed
                # Every full block had its try when it became full (here, or where a load ends):
                # unless a block became full now or a table lags, there is nothing to cache.
                if num_new > 1 or computed % bs == 0 or lagging:
                    kv.cache_blocks(req, computed)
                if not s.sample:
                    continue
                if not req.first_token_time:  # also marks the prompt done (prompt_done_once)
                    req.first_token_time = time.monotonic()
                token = next(sampled)
                req.append_output_token(token)
                add(req)
                # The common token ends nothing: only a possible stop takes the full check
                # (these are _check_stop's conditions: a new one goes in both).
                if (
                    token in req.eos_token_ids
                    or req.params.stop_token_ids
                    or len(req.output_token_ids) >= req.max_tokens
                    or len(req.all_token_ids) >= max_model_len
                    or req.remote_decode
                ):
                    status = self._check_stop(req, token)
                    if status is None and req.remote_decode:
                        status = RequestStatus.FINISHED_REMOTE_DECODE
                    if status is not None:
                        finished.append(req)
                        self._finish(req, status)
        finally:  # a step that raised midway leaves no ended request in running
            if finished:
                gone = set(map(id, finished))
                self.running[:] = [r for r in self.running if id(r) not in gone]
        return changed

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.params
        if token in req.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if params.stop_token_ids and token in params.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if (
            len(req.output_token_ids) >= req.max_tokens
            or len(req.all_token_ids) >= self.config.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """End a request that ran this step (update() then drops the step's ended ones from
        ``running`` at once)."""
        req.status = status
        self.decode_rows.pop(req.request_id, None)
        if status == RequestStatus.FINISHED_REMOTE_DECODE:
            self.pinned[req.request_id] = req
        else:
            self.kv.free(req)
        if req.group_index == 0 and self._leaders.get(req.group_id) is req:
            del self._leaders[req.group_id]

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort or stop requests by id (engine thread). Frees their blocks, pinned ones too."""
        ids = set(request_ids)
        done: list[Request] = []
        for queue in (self.running, self.waiting):
            for req in [r for r in queue if r.request_id in ids]:
                queue.remove(req)
                self.kv.free(req)
                req.status = status
                done.append(req)
        for rid in ids & self.loading.keys():
            # The connector may still be writing these blocks; finish_load frees them.
            req = self.loading[rid]
            if not req.is_finished:
                req.status = status
                done.append(req)
        for rid in ids & self.pinned.keys():
            req = self.pinned.pop(rid)
            self.kv.free(req)
            done.append(req)
        for req in done:
            self.decode_rows.pop(req.request_id, None)
            if self._leaders.get(req.group_id) is req:
                del self._leaders[req.group_id]
        return done

    def pin_prefix(self, req: Request) -> int:
        """A peer pulls this worker's cached prefix of ``req``'s prompt (whole blocks): pin the
        leading blocks cached here, like a handed-off request's, until ``release_pinned``.
        Returns the number of blocks pinned (0: nothing cached, nothing changes)."""
        hits: list[KVCacheBlock] = []
        for block_hash in req.block_hashes:
            block = self.kv.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit = len(hits) * self.kv.block_size
        if not hits or not self.kv.allocate_slots(req, 0, hits, num_hit):
            return 0
        req.num_computed_tokens = num_hit
        req.status = RequestStatus.FINISHED_REMOTE_DECODE
        self.pinned[req.request_id] = req
        return len(hits)

    def release_pinned(self, request_id: str) -> bool:
        """Prefill role: the decode worker has its copy (or gave up); free the pinned blocks."""
        req = self.pinned.pop(request_id, None)
        if req is None:
            return False
        self.kv.free(req)
        return True

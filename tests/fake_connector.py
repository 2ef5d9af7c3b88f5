"""An in-memory KVConnector for role-hook unit tests: records calls, finishes loads on demand."""

from __future__ import annotations

from tandem.engine.kv_connector import FailureReason, KVTransferParams, LoadResult


class FakeConnector:
    engine_id = "fake-engine"
    side_channel_address = "tcp://127.0.0.1:1"

    def __init__(self) -> None:
        self.published: list[tuple[str, list[int], int, int]] = []
        self.held: dict[str, KVTransferParams] = {}
        self.started: list[tuple[str, list[int], list[int]]] = []
        self.aborted: list[str] = []
        self._released: list[str] = []
        self._finished: list[LoadResult] = []
        self.closed = False

    # ---- KVConnector ----
    def publish(
        self, request_id: str, block_ids: list[int], num_tokens: int, first_token_id: int
    ) -> KVTransferParams:
        self.published.append((request_id, list(block_ids), num_tokens, first_token_id))
        return params_for(request_id, block_ids, num_tokens, first_token_id)

    def take_released(self) -> list[str]:
        out, self._released = self._released, []
        return out

    def hold(self, request_id: str, params: KVTransferParams) -> None:
        if request_id in self.held:
            raise ValueError(f"request {request_id!r} is already held or loading")
        self.held[request_id] = params

    def start_load(
        self,
        request_id: str,
        params: KVTransferParams,
        remote_block_ids: list[int],
        local_block_ids: list[int],
    ) -> None:
        if any(b not in params.block_ids for b in remote_block_ids):
            raise ValueError("remote_block_ids must be a subset of params.block_ids")
        self.held.pop(request_id, None)
        self.started.append((request_id, list(remote_block_ids), list(local_block_ids)))

    def take_finished_loads(self) -> list[LoadResult]:
        out, self._finished = self._finished, []
        return out

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def close(self) -> None:
        self.closed = True

    # ---- test controls ----
    def release(self, request_id: str) -> None:
        self._released.append(request_id)

    def finish(self, request_id: str, ok: bool = True) -> None:
        reason = None if ok else FailureReason.PEER_DISCONNECTED
        detail = None if ok else "prefill went away"
        self._finished.append(LoadResult(request_id, ok, reason, detail))


def params_for(
    request_id: str, block_ids: list[int], num_tokens: int, first_token_id: int
) -> KVTransferParams:
    return KVTransferParams(
        engine_id="prefill-engine",
        side_channel="tcp://127.0.0.1:1",
        remote_request_id=request_id,
        block_ids=tuple(block_ids),
        num_tokens=num_tokens,
        first_token_id=first_token_id,
        lease_seconds=10.0,
        transfer_secret="ab" * 32,
    )

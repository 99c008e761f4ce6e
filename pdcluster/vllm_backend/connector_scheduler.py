"""The scheduler side of pdcluster's connector inside vLLM (its engine-core process).

vLLM asks the connector, per request: how many tokens beyond the local prefix hit arrive from
outside (`get_num_new_matched_tokens`), which blocks were allocated for them
(`update_state_after_alloc`), and, when the request ends, whether its blocks must outlive it
(`request_finished`). The answers come from the project's own `ConnectorScheduler`
(transfer/connector_scheduler.py), the same bookkeeping the own engine uses, driven here with
vLLM's request ids and block ids; its plan travels to the worker side inside vLLM's
per-step connector metadata, and the worker's results come back in vLLM's worker metadata.

A transfer whose prefill node is lost (the node's notice, vllm_backend/lost.py) fails its
load: at the next step if the load is registered (the worker fails the receive, vLLM
recomputes), or as it is registered if not yet.

A request's part in a transfer is named by its `kv_transfer_params` (vllm_backend/engine.py
sets them from the router's `TransferSpec`):
- `{"pd": "remote_prefill", "transfer_id", "source_addr"}` on the decode node: the prompt's KV
  past the local hit arrives from the prefill node (unless less than a block is left, which
  the decode node computes itself); vLLM recomputes the last prompt token itself to sample
  the first output token.
- `{"pd": "remote_decode", "transfer_id"}` on the prefill node: when the request ends (it
  generates one token), its blocks stay allocated until the decode node's write is served.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdcluster.core.hashing import HashConfig
from pdcluster.core.kv_connector import ConnectorPlan, ConnectorResults
from pdcluster.core.kv_transfer import (
    KVTransferParams,
    PrefixPull,
    RemoteDecode,
    RemotePrefill,
    TransferId,
)
from pdcluster.core.pull_ticket import ticket_to_dict
from pdcluster.core.vllm_hashing import VLLM_HASH_ALGORITHM
from pdcluster.transfer.connector_scheduler import ConnectorScheduler
from pdcluster.vllm_backend.handshake import endpoint
from pdcluster.vllm_backend.lost import LostNotices, LostTransfers
from pdcluster.vllm_backend.pulls import PULL_KEY, VllmPulls
from pdcluster.vllm_backend.settings import ConnectorSettings

PD_KEY = "pd"


@dataclass(slots=True)
class StepPlan:
    """What the scheduler side hands its worker for one step (pickled by vLLM with the
    scheduler output): the connector plan, transfers to give up at their source without
    a receive (a decode node whose own cache held the whole prompt), and receives to fail
    because their source is lost."""

    plan: ConnectorPlan = field(default_factory=ConnectorPlan)
    released: list[tuple[TransferId, str]] = field(default_factory=list)  # (id, source addr)
    lost: list[tuple[TransferId, str]] = field(default_factory=list)  # (id, reason)


def transfer_params(params: dict[str, Any] | None) -> KVTransferParams | None:
    """The transfer a request takes part in, from its `kv_transfer_params`."""
    if not params or PD_KEY not in params:
        return None
    if params[PD_KEY] == "remote_prefill":
        return RemotePrefill(str(params["transfer_id"]), str(params["source_addr"]))
    if params[PD_KEY] == "remote_decode":
        return RemoteDecode(str(params["transfer_id"]))
    raise ValueError(f"unknown pd role {params[PD_KEY]!r} in kv_transfer_params")


def kv_transfer_params(transfer: KVTransferParams | None, pull: PrefixPull | None = None
                   ) -> dict[str, Any] | None:
    """The node's transfer (and prefix-pull hint) as the `kv_transfer_params` the connector
    reads (connector_scheduler.py, pulls.py)."""
    params: dict[str, Any] = {}
    if isinstance(transfer, RemotePrefill):
        params = {PD_KEY: "remote_prefill", "transfer_id": transfer.transfer_id,
                  "source_addr": transfer.source_addr}
    elif isinstance(transfer, RemoteDecode):
        params = {PD_KEY: "remote_decode", "transfer_id": transfer.transfer_id}
    if pull is not None:
        params[PULL_KEY] = {"source_addr": pull.source_addr, "num_blocks": pull.num_blocks,
                            "ticket": None if pull.ticket is None else ticket_to_dict(pull.ticket)}
    return params or None


class VllmSchedulerSide:
    """vLLM's scheduler-side connector calls, answered by `ConnectorScheduler`."""

    def __init__(self, settings: ConnectorSettings, block_size: int) -> None:
        self.block_size = block_size
        self.sched = ConnectorScheduler(settings.recompute_on_failure, settings.min_pull_blocks)
        lookups = endpoint(settings.handshake_dir, "lookups") if settings.handshake_dir else None
        self.pulls = VllmPulls(self.sched, block_size,
                               HashConfig(VLLM_HASH_ALGORITHM, settings.hash_seed), lookups)
        self._local_hit: dict[str, int] = {}  # request -> local prefix tokens, until allocated
        self._started: set[str] = set()  # requests whose transfer has been planned
        self._released: list[tuple[TransferId, str]] = []
        self._receives: dict[TransferId, str] = {}  # planned receives -> request, until it ends
        self._lost = LostTransfers()  # notices whose load is not registered yet
        self._failing: list[tuple[TransferId, str]] = []  # receives to fail at the next step
        self._notices = (LostNotices(endpoint(settings.handshake_dir, "lost"))
                         if settings.handshake_dir else None)

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        transfer = transfer_params(request.kv_transfer_params)
        if not isinstance(transfer, RemotePrefill):
            num_pulled = self.pulls.num_new_tokens(request, num_computed_tokens)
            return num_pulled, num_pulled > 0
        if request.request_id in self._started:
            return 0, False
        num_external = self.sched.num_external_tokens(
            request.request_id, transfer, request.num_prompt_tokens, num_computed_tokens)
        self._local_hit[request.request_id] = num_computed_tokens
        if num_external < self.block_size:
            # Less than a block left past the local hit (vLLM never counts the last prompt
            # token as a hit): computing it costs less than the round trip, and the prefill
            # node is released (on_allocated).
            return 0, False
        return num_external, True

    def on_allocated(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        transfer = transfer_params(request.kv_transfer_params)
        rid = request.request_id
        if not isinstance(transfer, RemotePrefill):
            self.pulls.on_allocated(request, block_ids, num_external_tokens)
            return
        if rid in self._started:
            return
        self._started.add(rid)
        num_local = self._local_hit.pop(rid, 0)
        if num_external_tokens <= 0:
            # The whole prompt was cached here: the prefill node holds blocks for nothing.
            self._lost.forget(transfer.transfer_id)
            self._released.append((transfer.transfer_id, transfer.source_addr))
            return
        num_blocks = -(-request.num_prompt_tokens // self.block_size)
        self.sched.on_allocated(rid, transfer, block_ids[:num_blocks],
                                num_local // self.block_size)
        self._receives[transfer.transfer_id] = rid
        reason = self._lost.take(transfer.transfer_id)
        if reason is not None:  # told before the load was registered: it fails as it starts
            self._fail_receive(transfer.transfer_id, reason)

    def on_finished(self, request: Any, block_ids: list[int], normally: bool) -> bool:
        """True: vLLM must keep the blocks until the worker reports the request."""
        rid = request.request_id
        self._local_hit.pop(rid, None)
        self.pulls.forget(rid)
        started = rid in self._started
        self._started.discard(rid)
        transfer = transfer_params(request.kv_transfer_params)
        if isinstance(transfer, RemoteDecode):
            if normally:
                return self.sched.on_finished(rid, transfer, block_ids,
                                              list(request.output_token_ids), [])
            return self.sched.on_aborted(rid, transfer)
        if isinstance(transfer, RemotePrefill):
            self._receives.pop(transfer.transfer_id, None)
            self._lost.forget(transfer.transfer_id)
            if rid in self.sched.receiving:  # aborted while the KV is on its way
                return self.sched.on_aborted(rid, transfer)
            if not started:  # aborted before its blocks existed: tell the prefill node
                self._released.append((transfer.transfer_id, transfer.source_addr))
            return False
        # no transfer: a pull of its prefix may still be writing into its blocks
        return not normally and self.sched.on_aborted(rid, None)

    def build(self) -> StepPlan:
        self._take_notices()
        step = StepPlan(self.sched.build_plan(), self._released, self._failing)
        self._released, self._failing = [], []
        return step

    def _take_notices(self) -> None:
        """Meet each lost-transfer notice with its load: a receive under way fails at this
        step (also one planned in this very step: the worker fails before it starts); a
        load not registered yet is remembered until it is."""
        if self._notices is None:
            return
        for transfer_id, reason in self._notices.take():
            rid = self._receives.get(transfer_id)
            if rid is None:
                self._lost.note(transfer_id, reason)
            elif rid in self.sched.receiving:
                self._fail_receive(transfer_id, reason)
            # else: its KV arrived (or failed) already, nothing is waiting for it

    def _fail_receive(self, transfer_id: TransferId, reason: str) -> None:
        self._receives.pop(transfer_id, None)
        self._failing.append((transfer_id, reason))

    def update(self, results: ConnectorResults) -> None:
        self.sched.update_from_results(results)
        self.pulls.serve(results.lookups)
        self.pulls.served(results.served)

    def has_pending_work(self) -> bool:
        """Transfers in flight keep vLLM's engine stepping (its loop idles otherwise, and
        the worker's results would wait for the next request)."""
        return (self.sched.num_in_flight > 0 or bool(self._released) or bool(self._failing)
                or self.pulls.has_pending_work())

    def close(self) -> None:
        self.pulls.close()
        if self._notices is not None:
            self._notices.close()

"""`PdclusterConnector`: pdcluster's KV connector as a vLLM `KVConnectorBase_V1`.

vLLM loads it by module path (`kv_connector_module_path`, settings.py) in two roles: in its
engine-core process as the scheduler side (connector_scheduler.py) and in each worker process
(one per tensor-parallel rank) as the worker side (connector_worker.py): rank 0's moves the
node's KV and reports, ranks r >= 1 only write their heads when rank 0 says (vllm_backend/
ranks.py), so vLLM counts a transfer finished on rank 0's word alone (`get_finished_count`).
This class only routes vLLM's calls to the side that answers them and wraps what crosses
between the two in vLLM's metadata types:

    scheduler --(StepPlan in PdclusterMetadata, with the step's scheduler output)--> worker
    worker --(ConnectorResults in PdclusterWorkerMetadata, with its model output)--> scheduler

The worker's transfer counters and latencies travel in `TransferStats`, which vLLM hands to
the node's stat logger (vllm_backend/stats.py). Either side, as it starts, ties its process's
life to its parent's (vllm_backend/lifeline.py): a node that dies takes vLLM's engine core and
worker with it. A worker on the CPU also turns torch.compile off (vllm_backend/eager.py): vLLM's
few compiled helpers would otherwise compile during the node's first requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.request import RequestStatus

from pdcluster.core.kv_connector import ConnectorResults
from pdcluster.vllm_backend.connector_scheduler import StepPlan, VllmSchedulerSide
from pdcluster.vllm_backend.connector_worker import VllmRankSide, VllmWorkerSide, _merge
from pdcluster.vllm_backend.eager import run_eager
from pdcluster.vllm_backend.lifeline import die_with_parent
from pdcluster.vllm_backend.settings import REQUIRED_LAYOUT, ConnectorSettings

_NORMAL_FINISH = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class PdclusterMetadata(KVConnectorMetadata):
    def __init__(self, step: StepPlan) -> None:
        self.step = step


@dataclass
class PdclusterWorkerMetadata(KVConnectorWorkerMetadata):
    results: ConnectorResults = field(default_factory=ConnectorResults)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PdclusterWorkerMetadata), type(other)
        return PdclusterWorkerMetadata(_merge(self.results, other.results))


@dataclass
class TransferStats(KVConnectorStats):
    """`data`: "counters" (the worker's running totals, a snapshot), "latencies" (the
    `TransferTiming`s finished since the last report) and "in_flight" (the scheduler
    side's)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for key, value in other.data.items():
            if key == "latencies":
                merged[key] = list(merged.get(key, [])) + list(value)
            else:
                merged[key] = value
        return TransferStats(merged)

    def reduce(self) -> dict[str, int | float]:
        counters = self.data.get("counters", {})
        return {name: value for name, value in counters.items()
                if isinstance(value, int | float)}

    def is_empty(self) -> bool:
        return not self.data


class PdclusterConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        die_with_parent()
        extra = self._kv_transfer_config.kv_connector_extra_config
        settings = ConnectorSettings.from_extra_config(dict(extra))
        self._scheduler: VllmSchedulerSide | None = None
        self._worker: VllmWorkerSide | None = None
        self._rank: VllmRankSide | None = None
        self._tp_rank, self._tp_size = 0, vllm_config.parallel_config.tensor_parallel_size
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = VllmSchedulerSide(settings, vllm_config.cache_config.block_size)
        else:
            if vllm_config.device_config.device_type == "cpu":
                run_eager()
            self._tp_rank = _tp_rank() if self._tp_size > 1 else 0
            if self._tp_rank:
                self._rank = VllmRankSide(settings, self._tp_rank)
            else:
                self._worker = VllmWorkerSide(settings)
        self._heads = _kv_heads(vllm_config)
        self._num_blocks = getattr(kv_cache_config, "num_blocks", None)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """LBHNC: each layer's block holds its KV heads outermost, one byte run, so a head
        range is one run and nodes of different TP map heads (connector_worker.kv_region).
        vLLM's CPU backend has only this layout; its GPU backends default to token-major
        LBNHC unless a connector asks. MLA's one latent head reads the same either way."""
        model = vllm_config.model_config
        if model is None or model.use_mla:
            return None
        return REQUIRED_LAYOUT

    # ---- scheduler side --------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.on_allocated(request, _first_group(blocks.get_block_ids()),
                                     num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return PdclusterMetadata(self._scheduler.build())

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, PdclusterWorkerMetadata):
            self._scheduler.update(meta.results)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self._scheduler is not None:  # prefix pulls served from vLLM's prefix cache
            self._scheduler.pulls.bind_pool(gpu_block_pool)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        assert self._scheduler is not None
        normally = request.status in _NORMAL_FINISH
        return self._scheduler.on_finished(request, _first_group(block_ids), normally), None

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    def get_finished_count(self) -> int:
        return 1  # rank 0 alone reports a transfer finished (it waited for every rank)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._scheduler is not None:
            return TransferStats({"in_flight": self._scheduler.sched.num_in_flight})
        if self._worker is None:
            return None  # rank 0 counts its group's transfers
        return TransferStats({"counters": self._worker.worker.counters(),
                              "latencies": self._worker.worker.take_latencies()})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return TransferStats(dict(data or {}))

    # ---- worker side -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        num_blocks = self._num_blocks or next(iter(kv_caches.values())).shape[0]
        if self._rank is not None:
            self._rank.register(kv_caches, num_blocks, self._heads)
            return
        assert self._worker is not None
        self._worker.register(kv_caches, num_blocks, self._heads, self._tp_size)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is None:
            return  # rank r >= 1: rank 0 runs the plan
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdclusterMetadata), type(meta)
        self._worker.start_loads(meta.step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # receives complete before vLLM schedules the request (async loading)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # nothing is saved per layer: a prefill node writes whole blocks when asked

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.after_forward()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                set[str] | None]:
        if self._worker is None:
            return None, None
        sending, recving, _ = self._worker.take_results()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )

        if self._worker is None:
            return KVConnectorTransferResults(set(), set(), set())
        sending, recving, failed = self._worker.take_results()
        return KVConnectorTransferResults(sending, recving, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        results = self._worker.take_worker_results()
        if not (results.received or results.released or results.pulled or results.lookups
                or results.served):
            return None
        return PdclusterWorkerMetadata(results)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._rank is not None:
            self._rank.close()
        if self._scheduler is not None:
            self._scheduler.close()


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _kv_heads(vllm_config: Any) -> tuple[int, int]:
    """(the model's KV heads, one rank's); MLA's latent is one head every rank holds."""
    model = vllm_config.model_config
    if model.use_mla:
        return (1, 1)
    return (int(model.get_total_num_kv_heads()),
            int(model.get_num_kv_heads(vllm_config.parallel_config)))


def _first_group(block_ids: Any) -> list[int]:
    """The block ids of the (only) KV cache group: vLLM passes one list per group."""
    if block_ids and isinstance(block_ids[0], list | tuple):
        return list(block_ids[0])
    return list(block_ids)

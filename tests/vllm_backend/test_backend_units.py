"""The vLLM backend's parts, each against vLLM's own code where vLLM defines the behaviour:
block hashes equal to vLLM's (so the router can name a vLLM node's blocks), the connector's
scheduler side on real vLLM `Request`s, the KV layout of vLLM-shaped cache tensors, and the
sampling options as vLLM's `SamplingParams`, and a lost prefill node's notice meeting its
transfer's load on the scheduler side. No engine runs here (tests/vllm_backend/
test_vllm_nodes.py runs them)."""

from __future__ import annotations

import time

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make setup-vllm)")

import torch  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from pdcluster.core.hashing import BlockExtra, BlockHasher, HashConfig, hash_block_tokens  # noqa: E402,E501
from pdcluster.core.kv_connector import ConnectorResults, RecvResult  # noqa: E402
from pdcluster.core.kv_transfer import RemoteDecode, RemotePrefill  # noqa: E402
from pdcluster.core.sampling import GuidedDecoding, SamplingSpec  # noqa: E402
from pdcluster.core.vllm_hashing import VLLM_DEFAULT_SEED, VLLM_HASH_ALGORITHM  # noqa: E402
from pdcluster.engine.config import EngineConfig  # noqa: E402
from pdcluster.vllm_backend.connector_scheduler import (  # noqa: E402
    StepPlan,
    VllmSchedulerSide,
    kv_transfer_params,
    transfer_params,
)
from pdcluster.vllm_backend.connector_worker import kv_region  # noqa: E402
from pdcluster.vllm_backend.handshake import endpoint  # noqa: E402
from pdcluster.vllm_backend.lost import LostNotifier  # noqa: E402
from pdcluster.vllm_backend.sampling import to_vllm_params  # noqa: E402
from pdcluster.vllm_backend.settings import ConnectorSettings, check_supported  # noqa: E402

VLLM_HASH = HashConfig(VLLM_HASH_ALGORITHM, VLLM_DEFAULT_SEED)
BLOCK = 32


def vllm_chain(tokens: list[int], salt: str | None = None) -> list[bytes]:
    """vLLM's own block hashes of `tokens` (its functions, its `sha256_cbor`)."""
    kv_cache_utils.init_none_hash(sha256_cbor)
    parent, hashes = None, []
    for start in range(0, len(tokens) // BLOCK * BLOCK, BLOCK):
        extra = (("cache_salt", salt),) if salt and start == 0 else None
        parent = kv_cache_utils.hash_block_tokens(sha256_cbor, parent,
                                                  tokens[start:start + BLOCK], extra)
        hashes.append(bytes(parent))
    return hashes


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_block_hashes_equal_vllms(salt) -> None:
    tokens = list(range(7, 7 + 5 * BLOCK + 9))
    expected = vllm_chain(tokens, salt)
    assert len(expected) == 5
    assert hash_block_tokens(tokens, BLOCK, BlockExtra(cache_salt=salt), VLLM_HASH) == expected
    hasher = BlockHasher(BLOCK, BlockExtra(cache_salt=salt), VLLM_HASH)
    for start in range(0, len(tokens), 13):  # any split gives the same chain
        hasher.extend(tokens[start:start + 13])
    assert hasher.block_hashes == expected


def test_salted_and_unsalted_chains_never_share_a_block() -> None:
    tokens = list(range(3 * BLOCK))
    assert not set(vllm_chain(tokens)) & set(vllm_chain(tokens, "t"))


def test_vllm_hashes_refuse_a_lora_id() -> None:
    with pytest.raises(ValueError, match="LoRA"):
        hash_block_tokens(list(range(BLOCK)), BLOCK, BlockExtra(lora_id=1), VLLM_HASH)


def test_a_vllm_engine_config_hashes_as_vllm_does() -> None:
    config = EngineConfig("m", backend="vllm", block_size=BLOCK)
    assert config.hash_config == VLLM_HASH
    check_supported(config)
    with pytest.raises(ValueError, match="speculative"):
        check_supported(EngineConfig("m", backend="vllm", block_size=BLOCK,
                                     speculative="ngram:k=2"))
    with pytest.raises(ValueError, match="block_size 16"):
        check_supported(EngineConfig("m", backend="vllm", block_size=16))
    with pytest.raises(ValueError, match="tensor_parallel_timeout_s"):
        check_supported(EngineConfig("m", backend="vllm", block_size=BLOCK,
                                     tensor_parallel_timeout_s=30.0))
    with pytest.raises(ValueError, match="overlap_decode"):
        check_supported(EngineConfig("m", backend="vllm", block_size=BLOCK,
                                     overlap_decode=False))
    with pytest.raises(ValueError, match="gpu_memory_utilization is a vLLM option"):
        EngineConfig("m", gpu_memory_utilization=0.5)  # the own engine sizes its KV cache


def test_tensor_parallel_vllm_is_served_on_cuda_but_a_token_major_layout_is_refused(
        monkeypatch) -> None:
    """On CUDA too the connector gets its head-outermost layout (it asks vLLM for LBHNC), so
    TP > 1 is accepted there; a layout forced through VLLM_KV_CACHE_LAYOUT that puts tokens
    outermost is refused by name before vLLM starts."""
    from pdcluster.vllm_backend import settings

    monkeypatch.setattr(settings, "_on_gpu", lambda: True)
    check_supported(EngineConfig("m", backend="vllm", block_size=16, device="cuda",
                                 tensor_parallel_size=2))
    for accepted in ("LBHNC", "HND", "BLHNC"):
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", accepted)
        check_supported(EngineConfig("m", backend="vllm", block_size=BLOCK))
    for refused in ("NHD", "LBNHC", "BHLNC"):
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", refused)
        with pytest.raises(ValueError, match=f"VLLM_KV_CACHE_LAYOUT={refused} .*LBHNC or BLHNC"):
            check_supported(EngineConfig("m", backend="vllm", block_size=BLOCK))


def test_vllms_ranks_are_processes_of_the_node(model_dirs, tmp_path) -> None:
    """At TP > 1 vLLM runs its ranks with its multiprocessing executor (the node actor holds
    their GPUs), never as Ray workers of their own, whatever Ray context the node is in."""
    from pdcluster.vllm_backend.settings import engine_args

    settings = ConnectorSettings(handshake_dir=str(tmp_path))
    for tp, backend in ((1, None), (2, "mp")):
        config = EngineConfig(model_dirs["llama-vllm"], backend="vllm", block_size=BLOCK,
                              tensor_parallel_size=tp)
        args = engine_args(config, settings, tmp_path)
        assert args["tensor_parallel_size"] == tp
        assert args["distributed_executor_backend"] == backend


# ---- the connector's scheduler side on vLLM's Request ----------------------------------


def make_request(rid: str, num_tokens: int, transfer=None, max_tokens: int = 4) -> Request:
    params = to_vllm_params(SamplingSpec(max_tokens=max_tokens, temperature=0.0),
                            kv_transfer_params(transfer), 20)
    return Request(rid, list(range(1, num_tokens + 1)), params, None)


def scheduler_side() -> VllmSchedulerSide:
    return VllmSchedulerSide(ConnectorSettings(handshake_dir=""), BLOCK)


def test_decode_side_asks_for_the_prompt_past_its_local_hit_then_plans_one_receive() -> None:
    side = scheduler_side()
    transfer = RemotePrefill("t1", "tcp://127.0.0.1:5555")
    request = make_request("d1", 100, transfer)
    assert transfer_params(request.kv_transfer_params) == transfer
    assert side.num_new_matched_tokens(request, 32) == (68, True)
    side.on_allocated(request, [7, 8, 9, 10], 68)
    plan = side.build().plan
    (recv,) = plan.recvs
    assert (recv.request_id, recv.block_ids, recv.skip_blocks) == ("d1", [7, 8, 9, 10], 1)
    assert side.num_new_matched_tokens(request, 32) == (0, False)  # planned once
    assert side.has_pending_work()
    side.update(ConnectorResults(received=[RecvResult("d1", True)]))
    assert not side.has_pending_work()


def test_less_than_a_block_past_the_local_hit_is_computed_and_releases_the_prefill_node(
        ) -> None:
    side = scheduler_side()
    request = make_request("d1", 65, RemotePrefill("t1", "tcp://p:1"))
    assert side.num_new_matched_tokens(request, 64) == (0, False)
    side.on_allocated(request, [1, 2, 3], 0)
    step = side.build()
    assert step.plan.recvs == [] and step.released == [("t1", "tcp://p:1")]


def test_prefill_side_keeps_a_finished_requests_blocks_until_released() -> None:
    side = scheduler_side()
    request = make_request("p1", 70, RemoteDecode("t1"), max_tokens=1)
    assert side.num_new_matched_tokens(request, 0) == (0, False)
    request.append_output_token_ids(42)
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert side.on_finished(request, [3, 4, 5], normally=True)
    (send,) = side.build().plan.sends
    assert (send.request_id, send.block_ids, send.first_token) == ("p1", [3, 4, 5], 42)
    assert side.has_pending_work()
    side.update(ConnectorResults(released=["p1"]))
    assert not side.has_pending_work()


def test_aborts_on_either_side_cancel_the_transfer() -> None:
    side = scheduler_side()
    waiting = make_request("d1", 64, RemotePrefill("t1", "tcp://p:1"))
    side.num_new_matched_tokens(waiting, 0)
    side.on_allocated(waiting, [1, 2], 64)
    side.build()
    # aborted while its KV is on the way: blocks stay until the worker reports the receive
    assert side.on_finished(waiting, [1, 2], normally=False)
    assert side.build().plan.cancelled == ["t1"]
    running = make_request("p1", 64, RemoteDecode("t2"), max_tokens=1)
    assert not side.on_finished(running, [5, 6], normally=False)  # nothing to send
    assert side.build().plan.cancelled == ["t2"]
    never_allocated = make_request("d2", 64, RemotePrefill("t3", "tcp://p:1"))
    assert not side.on_finished(never_allocated, [], normally=False)
    assert side.build().released == [("t3", "tcp://p:1")]


# ---- a lost prefill node's notice (vllm_backend/lost.py) --------------------------------

LOST = "prefill node lost: p0: disconnected"


@pytest.fixture
def told(tmp_path):
    """A decode node's scheduler side with its `lost` socket, and the node's end of it."""
    side = VllmSchedulerSide(ConnectorSettings(handshake_dir=str(tmp_path)), BLOCK)
    notifier = LostNotifier(endpoint(tmp_path, "lost"))
    yield side, notifier
    notifier.close()
    side.close()


def plan_receive(side: VllmSchedulerSide, rid: str, tid: str) -> StepPlan:
    request = make_request(rid, 100, RemotePrefill(tid, "tcp://p:1"))
    assert side.num_new_matched_tokens(request, 32) == (68, True)
    side.on_allocated(request, [1, 2, 3, 4], 68)
    return side.build()


def next_failing(side: VllmSchedulerSide) -> StepPlan:
    """Steps until one fails a receive (a notice crosses the socket asynchronously)."""
    deadline = time.monotonic() + 5
    while not (step := side.build()).lost:
        assert time.monotonic() < deadline, "no notice reached the scheduler side"
        time.sleep(0.005)
    return step


def test_a_registered_load_whose_source_is_lost_fails_at_the_next_step(told) -> None:
    side, notifier = told
    plan_receive(side, "d1", "t1")
    assert notifier.send("t1", LOST)
    assert next_failing(side).lost == [("t1", LOST)]
    assert side.build().lost == []  # once
    side.update(ConnectorResults(received=[RecvResult("d1", False, error=LOST)]))
    assert not side.has_pending_work()


def test_a_load_not_registered_yet_fails_as_it_is_registered(told) -> None:
    side, notifier = told
    plan_receive(side, "d1", "t1")
    # the notice for d2 comes before vLLM has scheduled d2; d1's shows it was read
    assert notifier.send("t2", LOST) and notifier.send("t1", LOST)
    assert next_failing(side).lost == [("t1", LOST)]
    step = plan_receive(side, "d2", "t2")
    assert [r.request_id for r in step.plan.recvs] == ["d2"]
    assert step.lost == [("t2", LOST)]  # the worker fails it before it asks the source


def test_a_notice_after_the_kv_arrived_or_the_request_ended_changes_nothing(told) -> None:
    side, notifier = told
    plan_receive(side, "d1", "t1")
    side.update(ConnectorResults(received=[RecvResult("d1", True)]))
    queued = make_request("d2", 100, RemotePrefill("t2", "tcp://p:1"))
    side.num_new_matched_tokens(queued, 32)
    plan_receive(side, "d3", "t3")  # an unrelated load: its notice shows the others were read
    assert notifier.send("t1", LOST) and notifier.send("t2", LOST) and notifier.send("t3", LOST)
    assert next_failing(side).lost == [("t3", LOST)]  # t1's KV is in: nothing to fail
    side.on_finished(queued, [], normally=False)  # aborted while queued: its notice goes too
    again = make_request("d4", 100, RemotePrefill("t2", "tcp://p:1"))  # (to show it is gone)
    side.num_new_matched_tokens(again, 32)
    side.on_allocated(again, [5, 6, 7, 8], 68)
    assert side.build().lost == []


def test_an_unknown_pd_role_is_refused() -> None:
    with pytest.raises(ValueError, match="pd role"):
        transfer_params({"pd": "sideways", "transfer_id": "t"})


# ---- the KV layout of vLLM's cache tensors ----------------------------------------------


def test_cpu_layout_is_one_segment_per_layer_with_block_major_runs() -> None:
    num_blocks = 6
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(num_blocks, 2, BLOCK, 64)
              for i in (1, 0)}  # vLLM CPU: [blocks, kv heads, block, 2 x head size]
    region = kv_region(caches, num_blocks, (2, 2))
    assert region.num_kv_heads == 2
    first = caches["model.layers.0.self_attn.attn"]
    second = caches["model.layers.1.self_attn.attn"]
    assert region.num_segments == 2 and region.base_addr == first.data_ptr()
    assert region.segment_offsets == (0, second.data_ptr() - first.data_ptr())
    assert region.block_nbytes == first[0].nbytes == region.stride
    assert region.block_addr(5) == first[5].data_ptr()
    spans = dict(region.memory_ranges())
    assert spans[first.data_ptr()] == first.nbytes and spans[second.data_ptr()] == second.nbytes


def test_a_layout_without_a_leading_block_dimension_is_refused() -> None:
    with pytest.raises(ValueError, match="not supported"):
        kv_region({"model.layers.0.attn": torch.zeros(BLOCK, 4, 3)}, 4, (4, 4))


# ---- sampling -------------------------------------------------------------------------------


def test_every_sampling_field_reaches_vllm() -> None:
    spec = SamplingSpec(max_tokens=9, min_tokens=2, temperature=0.7, top_p=0.9, top_k=5,
                        seed=3, stop=["\n"], stop_token_ids=[7], ignore_eos=True, logprobs=2,
                        presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1,
                        logit_bias={5: -1.0}, guided=GuidedDecoding("regex", "[ab]+"))
    params = to_vllm_params(spec, None, 20)
    assert (params.max_tokens, params.min_tokens, params.temperature, params.top_p,
            params.top_k, params.seed) == (9, 2, 0.7, 0.9, 5, 3)
    assert params.stop == ["\n"] and params.stop_token_ids == [7] and params.ignore_eos
    assert (params.logprobs, params.presence_penalty, params.frequency_penalty,
            params.repetition_penalty) == (2, 0.5, 0.25, 1.1)
    assert params.logit_bias == {5: -1.0}
    assert params.structured_outputs.regex == "[ab]+"
    assert params.detokenize  # stop strings need the text
    with pytest.raises(ValueError, match="logprobs=30"):
        to_vllm_params(SamplingSpec(logprobs=30), None, 20)
    with pytest.raises(ValueError):
        to_vllm_params(SamplingSpec(temperature=-1.0), None, 20)  # vLLM's own range check


# ---- vLLM's stat loggers ---------------------------------------------------------------


@pytest.mark.parametrize("serialized", [False, True])
def test_two_engines_built_at_once_in_one_process_register_their_metrics_in_turn(
        model_dirs, tmp_path, monkeypatch, serialized) -> None:
    """vLLM's Prometheus logger unregisters every `vllm:` metric, then registers its own: two
    built at once (a test's pair of nodes starting together) race, and the second fails with
    `DuplicateTimeseries` -- unless built under the node's lock, as VllmEngine builds them."""
    from concurrent.futures import ThreadPoolExecutor

    from prometheus_client.registry import DuplicateTimeseries
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.metrics import loggers

    from pdcluster.vllm_backend.settings import engine_args
    from pdcluster.vllm_backend.stats import SerializedPrometheusStatLogger

    config = EngineConfig(model_dirs["llama-vllm"], backend="vllm", block_size=BLOCK)
    vllm_config = AsyncEngineArgs(**engine_args(
        config, ConnectorSettings(handshake_dir=str(tmp_path)), tmp_path,
        with_connector=False)).create_engine_config()
    unregister = loggers.unregister_vllm_metrics

    def slow_unregister() -> None:  # widens the window between unregistering and registering
        unregister()
        time.sleep(0.2)

    monkeypatch.setattr(loggers, "unregister_vllm_metrics", slow_unregister)
    logger_class = SerializedPrometheusStatLogger if serialized else loggers.PrometheusStatLogger
    with ThreadPoolExecutor(2) as pool:
        built = [pool.submit(logger_class, vllm_config, [0]) for _ in range(2)]
    errors = [f.exception() for f in built if f.exception() is not None]
    if serialized:
        assert errors == []
    else:
        assert errors and isinstance(errors[0], DuplicateTimeseries), errors


@pytest.mark.parametrize("serialized", [False, True])
def test_two_engines_up_in_one_process_both_log_their_cache_config(
        model_dirs, tmp_path, serialized) -> None:
    """Once up, an engine registers `vllm:cache_config_info` without unregistering first: two
    loggers built in turn and then both logging (a pair of nodes whose starts interleave) meet
    `DuplicateTimeseries` in vLLM's logger; the node's replaces the earlier engine's gauge."""
    from prometheus_client import REGISTRY
    from prometheus_client.registry import DuplicateTimeseries
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.metrics import loggers

    from pdcluster.vllm_backend.settings import engine_args
    from pdcluster.vllm_backend.stats import SerializedPrometheusStatLogger

    config = EngineConfig(model_dirs["llama-vllm"], backend="vllm", block_size=BLOCK)
    vllm_config = AsyncEngineArgs(**engine_args(
        config, ConnectorSettings(handshake_dir=str(tmp_path)), tmp_path,
        with_connector=False)).create_engine_config()
    logger_class = SerializedPrometheusStatLogger if serialized else loggers.PrometheusStatLogger
    first, second = logger_class(vllm_config, [0]), logger_class(vllm_config, [0])
    first.log_engine_initialized()
    if not serialized:
        with pytest.raises(DuplicateTimeseries):
            second.log_engine_initialized()
        return
    second.log_engine_initialized()
    second.log_engine_initialized()  # and again: still one gauge of that name
    assert REGISTRY.get_sample_value(
        "vllm:cache_config_info", {**{k: str(v) for k, v in
                                      vllm_config.cache_config.metrics_info().items()},
                                   "engine": "0"}) == 1.0

"""Factories for disaggregated-engine tests: a prefill/decode engine pair joined by a KV
connector, and a driver that runs one request through both."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from pdcluster.core.kv_connector import KVConnector
from pdcluster.core.kv_transfer import RemoteDecode, RemotePrefill
from pdcluster.engine import LLMEngine, SamplingParams
from pdcluster.transfer.connector_scheduler import ConnectorScheduler
from pdcluster.transfer.connector_worker import ConnectorWorker

_ids = itertools.count()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_engine(model_dir: str, transport, *, timeout_s: float = 5.0, clock=time.monotonic,
                recompute_on_failure: bool = True, min_pull_blocks: int = 2,
                **options) -> LLMEngine:
    worker = ConnectorWorker(transport, timeout_s=timeout_s, clock=clock)
    connector = KVConnector(ConnectorScheduler(recompute_on_failure, min_pull_blocks), worker)
    options.setdefault("num_kv_blocks", 128)
    options.setdefault("block_size", 8)
    return LLMEngine.from_model(model_dir, kv_connector=connector, **options)


@dataclass
class DisaggRun:
    prefill_id: str
    decode_id: str
    transfer_id: str


def submit(prefill: LLMEngine | None, decode: LLMEngine, prompt: list[int],
           params: SamplingParams, prefill_addr: str) -> DisaggRun:
    """Send the request to both nodes, as the router does (D first: it may be early)."""
    n = next(_ids)
    run = DisaggRun(f"p-{n}", f"d-{n}", f"t-{n}")
    decode.add_request(run.decode_id, prompt, params,
                       kv_transfer=RemotePrefill(run.transfer_id, prefill_addr))
    if prefill is not None:
        prefill.add_request(run.prefill_id, prompt,
                            SamplingParams(temperature=params.temperature, max_tokens=1,
                                           ignore_eos=True, seed=params.seed),
                            kv_transfer=RemoteDecode(run.transfer_id))
    return run


def drive(engines: list[LLMEngine], until, timeout_s: float = 30.0, on_step=None) -> dict:
    """Step every engine until `until()`; returns the final RequestOutput per request id."""
    final = {}
    deadline = time.monotonic() + timeout_s
    while not until():
        if time.monotonic() > deadline:
            raise TimeoutError("disaggregated run did not finish")
        for engine in engines:
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        if on_step is not None:
            on_step()
        time.sleep(0.001)
    return final


def idle(engine: LLMEngine) -> bool:
    return not engine.has_unfinished_requests() and not engine.has_pinned_blocks()

"""A request's state inside the engine (torch-free): its tokens, progress and status.

`num_computed_tokens` counts tokens whose KV is in the cache. The newest sampled token is in
`all_token_ids` but not yet computed, so a request in decode has
`num_computed_tokens == num_tokens - 1`. Block hashes of full blocks grow incrementally with
the tokens (`core.hashing.BlockHasher`).
"""

from __future__ import annotations

import enum
import time

from pdcluster.core.hashing import (
    DEFAULT_HASH_CONFIG,
    NO_EXTRA,
    BlockExtra,
    BlockHasher,
    HashConfig,
)
from pdcluster.core.kv_transfer import KVTransferParams, PrefixPull
from pdcluster.core.types import ReqId
from pdcluster.engine.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # holds blocks, not scheduled
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # e.g. a failed KV transfer under the "fail" policy

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}


class Request:
    def __init__(self, request_id: ReqId, prompt_token_ids: list[int], params: SamplingParams,
                 block_size: int, eos_token_ids: tuple[int, ...] = (),
                 extra: BlockExtra | None = None, hash_config: HashConfig | None = None,
                 arrival_time: float | None = None,
                 kv_transfer: KVTransferParams | None = None,
                 prefix_pull: PrefixPull | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 = not yet
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.kv_transfer = kv_transfer
        self.prefix_pull = prefix_pull  # cleared once the pull has been tried
        self.num_emitted_tokens = 0  # output tokens already returned by LLMEngine.step
        self.error: str | None = None
        self.extra = extra or NO_EXTRA  # the hash's extra keys: cache salt, LoRA
        self.hasher = BlockHasher(block_size, self.extra, hash_config or DEFAULT_HASH_CONFIG)
        self.hasher.extend(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def block_hashes(self) -> list[bytes]:
        return self.hasher.block_hashes

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prefilling(self) -> bool:
        """True while more than the newest token awaits computing (prompt or recompute)."""
        return self.num_tokens - self.num_computed_tokens > 1

    def append_output_token(self, token_id: int, logprob: float | None = None,
                            top: list[tuple[int, float]] | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.hasher.extend((token_id,))
        if logprob is not None:
            self.logprobs.append(logprob)
        if top is not None:
            self.top_logprobs.append(top)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")

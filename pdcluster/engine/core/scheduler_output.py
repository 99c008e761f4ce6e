"""The scheduler's configuration and its per-step plan (torch-free): `SchedulerConfig`, and
`SchedulerOutput`, the list of `ScheduledRequest` chunks the model runner computes."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdcluster.core.types import ReqId
from pdcluster.engine.core.request import Request


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 2048
    max_pinned_blocks: int | None = None  # blocks held for other nodes; None: the whole pool
    pin_timeout_s: float = 10.0  # the longest a finished request's blocks wait for a send

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_pinned_blocks is not None and self.max_pinned_blocks < 1:
            raise ValueError(f"max_pinned_blocks must be >= 1, got {self.max_pinned_blocks}")
        if not self.pin_timeout_s > 0:
            raise ValueError(f"pin_timeout_s must be > 0, got {self.pin_timeout_s}")


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    start: int  # first position computed this step
    num_tokens: int
    block_ids: list[int]
    # Proposed tokens computed after the request's last token, counted in `num_tokens`
    # (speculative decoding, engine/spec_decode): verified, not yet the request's own.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the request's last known token (so a token is drawn)."""
        return self.start + self.num_tokens - len(self.spec_token_ids) == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens this chunk computes: the request's, then any proposed ones."""
        end = self.start + self.num_tokens - len(self.spec_token_ids)
        return self.request.all_token_ids[self.start:end] + self.spec_token_ids


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[ReqId] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

"""Per-request sampling parameters, validated once at construction (torch-free).

`SamplingParams` checks everything that needs no knowledge of the model: types, finite ranges
and sizes. What depends on the model or the engine (token ids within the vocabulary, logprobs
within `EngineConfig.max_logprobs`, the prompt plus `max_tokens` within the model length) is
checked by `LLMEngine.add_request`. A request that passes both cannot make a step raise.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, fields

from pdcluster.core.sampling import SamplingSpec

_GREEDY_EPS = 1e-5
MAX_TEMPERATURE = 100.0  # far past any useful value; keeps logits / temperature finite
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The fields of `core.sampling.SamplingSpec` (same names, meanings and defaults) plus
    the text options only the engine uses. Stop strings end generation and are cut from the
    text unless `include_stop_str_in_output`.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept lists (and a single stop string) from callers while staying hashable/frozen.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, 0)  # 0 disables it
        if self.seed is not None:
            _check_int("seed", self.seed, *SEED_RANGE)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0)
        self._validate_stops()

    def _validate_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must be non-empty strings of at most "
                                 f"{MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got "
                             f"{len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0)

    @classmethod
    def from_spec(cls, spec: SamplingSpec) -> SamplingParams:
        """From the wire's `SamplingSpec`: each of its fields, by name (this class has them
        all, with the same defaults; the others keep their defaults). Validates."""
        return cls(**{f.name: getattr(spec, f.name) for f in fields(spec)})

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        upper = "" if high is None else f", {high}"
        raise ValueError(f"{name} must be in [{low}{upper}], got {value}")


def _check_float(name: str, value: object, low: float, high: float,
                 low_open: bool = False) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    above_low = value > low if low_open else value >= low
    if not (math.isfinite(value) and above_low and value <= high):
        interval = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ValueError(f"{name} must be a finite number in {interval}, got {value}")


def as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)

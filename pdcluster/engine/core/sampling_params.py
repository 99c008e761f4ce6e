"""Per-request sampling parameters, validated once at construction (torch-free).

`SamplingParams` checks everything that needs no knowledge of the model: types, finite ranges
and sizes. What depends on the model or the engine (token ids within the vocabulary, logprobs
within `EngineConfig.max_logprobs`, the prompt plus `max_tokens` within the model length) is
checked by `LLMEngine.add_request`. A request that passes both cannot make a step raise.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, fields

from pdcluster.core.sampling import (
    GUIDED_KINDS,
    GuidedDecoding,
    SamplingSpec,
    guided_nesting_error,
)

_GREEDY_EPS = 1e-5
MAX_TEMPERATURE = 100.0  # far past any useful value; keeps logits / temperature finite
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed accepts
MAX_LOGIT_BIAS = 1024  # entries
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: -100 bans a token, +100 forces it
PENALTY_RANGE = 2.0  # presence / frequency, OpenAI's
MAX_REPETITION_PENALTY = 100.0  # past any useful value; keeps logits finite
MAX_GUIDED_SPEC_CHARS = 256 << 10


@dataclass(frozen=True, slots=True)
class SamplingParams(SamplingSpec):
    """The wire's sampling fields, inherited from `core.sampling.SamplingSpec` (their one
    declaration: same names, meanings and defaults), plus the text options only the engine
    uses. Stop strings end generation and are cut from the text unless
    `include_stop_str_in_output`. `detokenize=False` (vLLM's option) leaves the output's text
    empty: token ids only; stop strings need the text, so they refuse it.
    """

    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        # Accept tuples (and a single stop string) from callers, and keep copies: a caller's
        # list changed later must not change a request already admitted.
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _checked_logit_bias(self.logit_bias))
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
        _check_float("presence_penalty", self.presence_penalty, -PENALTY_RANGE, PENALTY_RANGE)
        _check_float("frequency_penalty", self.frequency_penalty, -PENALTY_RANGE,
                     PENALTY_RANGE)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0,
                     MAX_REPETITION_PENALTY, low_open=True)
        if self.guided is not None:
            check_guided(self.guided)
        self._validate_stops()

    def _validate_stops(self) -> None:
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
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
        """From the wire's `SamplingSpec`: each of its fields (the engine-only ones keep
        their defaults). Validates."""
        return cls(**{f.name: getattr(spec, f.name) for f in fields(spec)})

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _checked_logit_bias(bias: object) -> dict[int, float]:
    """A copy of `bias` (token id -> float); ids are checked against the vocabulary by the
    engine (engine.core.validation)."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a map of token id to bias, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    for token_id, value in bias.items():
        _check_int("logit_bias token id", token_id, 0)
        _check_float("logit_bias value", value, -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE)
    return {int(t): float(v) for t, v in bias.items()}


def check_guided(guided: object) -> None:
    """The form of a structured-output constraint (its grammar is compiled, and so fully
    checked, when the engine admits the request)."""
    if not isinstance(guided, GuidedDecoding):
        raise ValueError(f"guided must be a GuidedDecoding, got {type(guided).__name__}")
    if guided.kind not in GUIDED_KINDS:
        raise ValueError(f"guided.kind must be one of {GUIDED_KINDS}, got {guided.kind!r}")
    if not isinstance(guided.spec, str) or len(guided.spec) > MAX_GUIDED_SPEC_CHARS:
        raise ValueError(f"guided.spec must be a string of at most {MAX_GUIDED_SPEC_CHARS} "
                         f"characters")
    if guided.kind == "json_object":
        if guided.spec:
            raise ValueError("guided.spec must be empty for kind 'json_object'")
        return
    if not guided.spec:
        raise ValueError(f"guided.spec is empty for kind {guided.kind!r}")
    too_deep = guided_nesting_error(guided.kind, guided.spec)
    if too_deep:
        raise ValueError(f"guided.spec {too_deep}")
    if guided.kind in ("json_schema", "choice"):
        _check_guided_json(guided)


def _check_guided_json(guided: GuidedDecoding) -> None:
    try:
        value = json.loads(guided.spec)
    except ValueError:
        raise ValueError(f"guided.spec is not valid JSON for kind {guided.kind!r}") from None
    if guided.kind == "json_schema" and not isinstance(value, dict | bool):
        raise ValueError("guided.spec must be a JSON schema (an object) for kind "
                         "'json_schema'")
    if guided.kind == "choice" and not (isinstance(value, list) and value
                                        and all(isinstance(c, str) and c for c in value)):
        raise ValueError("guided.spec must be a JSON list of non-empty strings for kind "
                         "'choice'")


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    number = int(value)
    if number < low or (high is not None and number > high):
        upper = "" if high is None else f", {high}"
        raise ValueError(f"{name} must be in [{low}{upper}], got {value}")


def _check_float(name: str, value: object, low: float, high: float,
                 low_open: bool = False) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    number = float(value)
    above_low = number > low if low_open else number >= low
    if not (math.isfinite(number) and above_low and number <= high):
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

"""One source for the sampling fields: `core.sampling.SamplingSpec` declares them;
`engine.SamplingParams` inherits them and the router's `CompletionRequest` holds a spec, so
neither declares one of its own, and each side has one converter (`SamplingParams.from_spec`,
`CompletionRequest.sampling_spec`)."""

from __future__ import annotations

from dataclasses import fields

from pdcluster.core.sampling import SamplingSpec
from pdcluster.engine.core.sampling_params import SamplingParams
from pdcluster.router.api.protocol import CompletionRequest

WIRE_FIELDS = {f.name for f in fields(SamplingSpec)}


def _declared(cls: type) -> set[str]:
    """The fields a class declares itself (not the ones it inherits)."""
    return set(cls.__dict__.get("__annotations__", {}))


def test_the_engine_declares_only_its_own_fields() -> None:
    assert issubclass(SamplingParams, SamplingSpec)
    assert _declared(SamplingParams) == {"include_stop_str_in_output", "skip_special_tokens",
                                         "detokenize"}
    assert {f.name for f in fields(SamplingParams)} >= WIRE_FIELDS


def test_the_router_declares_no_sampling_field_but_its_max_tokens() -> None:
    """`max_tokens` is the client's (None: up to the context), resolved before a spec is
    made; every other sampling field lives in `CompletionRequest.sampling`."""
    assert _declared(CompletionRequest) & WIRE_FIELDS == {"max_tokens"}
    assert {f.name: f.type for f in fields(CompletionRequest)}["sampling"] == "SamplingSpec"


def test_from_spec_carries_every_field() -> None:
    spec = SamplingSpec(max_tokens=7, min_tokens=2, temperature=0.5, top_p=0.9, top_k=3,
                        seed=11, stop=["x"], stop_token_ids=[2, 3], ignore_eos=True,
                        logprobs=1, presence_penalty=0.5, frequency_penalty=-0.5,
                        repetition_penalty=1.5, logit_bias={4: 1.0})
    params = SamplingParams.from_spec(spec)
    for name in WIRE_FIELDS:
        assert getattr(params, name) == getattr(spec, name), name


def test_the_engine_copies_what_the_caller_passed() -> None:
    stops = ["a"]
    params = SamplingParams(stop=stops, stop_token_ids=(5,))
    stops.append("b")
    assert (params.stop, params.stop_token_ids) == (["a"], [5])
    assert SamplingParams(stop="end").stop == ["end"]


def test_the_router_fills_the_spec_from_the_request() -> None:
    req = CompletionRequest(model="m", chat=False, prompt="hi", sampling=SamplingSpec(
        temperature=0.2, top_p=0.8, top_k=5, seed=3, stop=["\n"], logprobs=2))
    spec = req.sampling_spec(max_tokens=9, stop_token_ids=[0])
    assert spec == SamplingSpec(max_tokens=9, temperature=0.2, top_p=0.8, top_k=5, seed=3,
                                stop_token_ids=[0], logprobs=2)

"""One source for the sampling fields: `core.sampling.SamplingSpec` defines what crosses the
wire, `engine.SamplingParams` carries the same fields with the same defaults, and each side
has one converter (`SamplingParams.from_spec`, `CompletionRequest.sampling_spec`)."""

from __future__ import annotations

from dataclasses import MISSING, Field, fields

from pdcluster.core.sampling import SamplingSpec
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.router.api.protocol import CompletionRequest


def _default(f: Field) -> object:
    value = f.default_factory() if f.default_factory is not MISSING else f.default
    return tuple(value) if isinstance(value, list) else value


def test_the_engine_has_every_wire_field_with_its_default() -> None:
    engine_fields = {f.name: f for f in fields(SamplingParams)}
    for f in fields(SamplingSpec):
        assert f.name in engine_fields, f.name
        assert _default(engine_fields[f.name]) == _default(f), f.name


def test_from_spec_carries_every_field() -> None:
    spec = SamplingSpec(max_tokens=7, min_tokens=2, temperature=0.5, top_p=0.9, top_k=3,
                        seed=11, stop=["x"], stop_token_ids=[2, 3], ignore_eos=True,
                        logprobs=1)
    params = SamplingParams.from_spec(spec)
    for f in fields(SamplingSpec):
        got = getattr(params, f.name)
        want = getattr(spec, f.name)
        assert (list(got) if isinstance(got, tuple) else got) == want, f.name


def test_the_router_fills_the_spec_from_the_request() -> None:
    req = CompletionRequest(model="m", chat=False, prompt="hi", temperature=0.2, top_p=0.8,
                            top_k=5, seed=3, stop=["\n"], logprobs=2)
    spec = req.sampling_spec(max_tokens=9, stop_token_ids=[0])
    assert spec == SamplingSpec(max_tokens=9, temperature=0.2, top_p=0.8, top_k=5, seed=3,
                                stop_token_ids=[0], logprobs=2)

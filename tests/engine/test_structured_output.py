"""Structured output through `LLM` / `LLMEngine` on a tiny random model: whatever its logits,
json_schema output validates with `jsonschema`, regex / choice / grammar outputs match, a
finished grammar finishes the request, a malformed spec is refused for its own request only,
a guided row never changes its unguided neighbours' tokens, and the mask covers a padded
vocabulary (ids the tokenizer lacks are never allowed)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pdcluster.core.sampling import GuidedDecoding
from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.models.tiny_model import make_tiny_model
from tests.helpers import assert_pool_clean
from tests.models import random_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe later"]
LARK = 'start: "(" num ("+" num)? ")"\nnum: /[0-9]{1,3}/'
SEEDS = (0, 1, 2)


def guided(kind: str, spec: object = "") -> GuidedDecoding:
    return GuidedDecoding(kind, spec if isinstance(spec, str) else json.dumps(spec))


def params(guide: GuidedDecoding, seed: int | None = None, **extra) -> SamplingParams:
    extra.setdefault("max_tokens", 64)
    temperature = 0.0 if seed is None else 1.0
    return SamplingParams(temperature=temperature, seed=seed, guided=guide, **extra)


@pytest.fixture(scope="module")
def model_dir(model_dirs) -> str:
    return model_dirs["llama-gqa"]


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, num_kv_blocks=256, block_size=8)


def run(llm: LLM, guide: GuidedDecoding, **extra) -> list:
    """Greedy and three seeded samples of one prompt each, all finished by the grammar."""
    prompts = random_prompts(4, 3, 12, seed=7)
    settings = [params(guide, **extra)] + [params(guide, seed, **extra) for seed in SEEDS]
    outs = llm.generate(prompts, settings)
    for out in outs:
        assert out.finish_reason == "stop", out.text
    assert_pool_clean(llm.engine.block_pool)
    assert not llm.engine.runner.sampler.structured._states
    return outs


def test_json_schema_output_validates(llm) -> None:
    for out in run(llm, guided("json_schema", SCHEMA)):
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_regex_output_matches(llm) -> None:
    for out in run(llm, guided("regex", REGEX)):
        assert re.fullmatch(REGEX, out.text), out.text


def test_choice_output_is_one_of_the_choices_and_ends_without_eos(llm) -> None:
    outs = run(llm, guided("choice", CHOICES), ignore_eos=True)
    for out in outs:
        assert out.text in CHOICES
        assert 2 not in out.token_ids  # the grammar's end finished it, not an EOS


def test_lark_grammar_output_matches(llm) -> None:
    for out in run(llm, guided("grammar", LARK)):
        assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})?\)", out.text), out.text


def test_json_object_output_parses(llm) -> None:
    """Any JSON object: biased towards closing it (a random model otherwise writes strings
    longer than any test's budget); the bias cannot break the grammar."""
    vocab = llm.engine.tokenizer.get_vocab()
    weights = {'"': 6.0, "}": 3.0, "{": -5.0, '{"': -5.0, "[": -5.0, '":{': -5.0}
    close = {vocab[piece]: bias for piece, bias in weights.items() if piece in vocab}
    for out in run(llm, guided("json_object"), logit_bias=close):
        assert isinstance(json.loads(out.text), dict)


def test_seeded_guided_sampling_is_reproducible(llm) -> None:
    guide = guided("json_schema", SCHEMA)
    first = llm.generate([[1, 5, 6]], params(guide, seed=5))[0].token_ids
    assert llm.generate([[1, 5, 6]], params(guide, seed=5))[0].token_ids == first


@pytest.mark.parametrize("guide, match", [
    (guided("regex", "a(b"), r"(?s)guided \(regex\).*unclosed group"),
    (guided("json_schema", {"type": "objectx"}), r"guided \(json_schema\)"),
    (guided("grammar", "start: undefined_rule"), r"(?s)guided \(grammar\).*undefined_rule"),
], ids=["regex", "json_schema", "grammar"])
def test_a_malformed_spec_fails_only_its_own_request(llm, model_dir, hf_reference, guide,
                                                     match) -> None:
    engine = llm.engine
    prompts = random_prompts(2, 4, 10, seed=3)
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("plain", prompts[0], plain)
    engine.add_request("json", prompts[1], params(guided("json_schema", SCHEMA)))
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompts[1], params(guide))
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(final) == {"plain", "json"}
    assert final["plain"].token_ids == hf_reference(model_dir, prompts[0], 6)
    jsonschema.validate(json.loads(final["json"].text), SCHEMA)
    assert_pool_clean(engine.block_pool)


@pytest.mark.parametrize("guide, match", [
    (GuidedDecoding("yaml", "a: 1"), "guided.kind"),
    (GuidedDecoding("json_schema", "{not json"), "not valid JSON"),
    (GuidedDecoding("json_schema", "[1, 2]"), "JSON schema"),
    (GuidedDecoding("choice", '["a", 3]'), "list of non-empty strings"),
    (GuidedDecoding("choice", "[]"), "list of non-empty strings"),
    (GuidedDecoding("regex", ""), "empty"),
    (GuidedDecoding("json_object", "{}"), "must be empty"),
    (GuidedDecoding("regex", "a" * (300 << 10)), "at most"),
], ids=lambda v: getattr(v, "kind", str(v))[:20])
def test_malformed_guided_fields_are_refused_by_sampling_params(guide, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(guided=guide)


def test_a_guided_row_leaves_its_neighbours_tokens_unchanged(llm, model_dir,
                                                             hf_reference) -> None:
    prompts = random_prompts(3, 4, 16, seed=11)
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, [plain, params(guided("regex", REGEX)), plain])
    for i in (0, 2):
        assert outs[i].token_ids == hf_reference(model_dir, prompts[i], 10)
    assert re.fullmatch(REGEX, outs[1].text)


def allowed_first_tokens(llm: LLM, guide: GuidedDecoding) -> list[int]:
    compiler = llm.engine.grammars
    mask = torch.zeros(compiler.mask_words, dtype=torch.int32)
    compiler.matcher(guide).unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
    bits = (mask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(-1).nonzero().view(-1).tolist()


def test_no_token_left_fails_the_request_alone(llm) -> None:
    """min_tokens bans, as stop tokens, every token the grammar allows first."""
    guide = guided("choice", ["yes"])
    first = allowed_first_tokens(llm, guide)
    assert 0 < len(first) < 64
    bad = params(guide, min_tokens=2, stop_token_ids=first)
    ok = params(guided("regex", REGEX))
    outs = llm.generate([[1, 5], [1, 6]], [bad, ok])
    assert outs[0].finish_reason == "error" and "no token is allowed" in outs[0].error
    assert re.fullmatch(REGEX, outs[1].text)
    assert_pool_clean(llm.engine.block_pool)


def test_the_mask_covers_a_padded_vocabulary(tmp_path) -> None:
    """The model has 64 more ids than its tokenizer: the grammar never allows them, not even
    with a +100 bias on one of them."""
    model = make_tiny_model(tmp_path / "padded", vocab_size=32064)
    llm = LLM(str(model), num_kv_blocks=64, block_size=8)
    bias = {32010: 100.0}
    outs = llm.generate([[1, 5, 6], [1, 7]], [params(guided("regex", REGEX), logit_bias=bias),
                                              params(guided("json_object"), seed=1,
                                                     logit_bias=bias, max_tokens=8)])
    assert re.fullmatch(REGEX, outs[0].text)
    assert all(t < 32000 for out in outs for t in out.token_ids)
    structured = llm.engine.runner.sampler.structured
    assert structured.compiler.mask_words * 32 >= 32064


def test_the_real_model_answers_within_the_grammar(real_llm) -> None:
    """SmolLM2 asked for a cat as JSON: schema-valid JSON, any-object JSON, and a choice."""
    tokenizer = real_llm.engine.tokenizer
    messages = [{"role": "user", "content": "Describe a pet cat as JSON: name, age, pet, tags."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    schema, any_object, choice = real_llm.generate([prompt] * 3, [
        params(guided("json_schema", SCHEMA), max_tokens=128),
        params(guided("json_object"), max_tokens=256),
        params(guided("choice", ["cat", "dog"]))])
    assert schema.finish_reason == any_object.finish_reason == "stop"
    jsonschema.validate(json.loads(schema.text), SCHEMA)
    assert isinstance(json.loads(any_object.text), dict)
    assert choice.text in ("cat", "dog")

"""`SamplingSpec`: the one definition of the sampling fields that cross the wire — what the
router asks for and a node accepts (a field of `core.node_wire.GenerateRequest`).

Nothing else declares them: `engine.SamplingParams` inherits them (adding the text options
only the engine uses, and the range checks) and is built from a spec by
`SamplingParams.from_spec`; the router's `CompletionRequest` holds the client's as a spec and
makes the node's with `CompletionRequest.sampling_spec` (tests/engine/test_sampling_fields.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated

from pdcluster.core.wire import MaxLen

GUIDED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# What the wire carries at most: looser than the engine's own limits
# (engine/core/sampling_params.py), so a request past those is refused by the engine with the
# field's name, not dropped as malformed; tight enough to bound what one frame can cost to
# decode (core.wire).
WIRE_MAX_GUIDED_SPEC_CHARS = 1 << 20
WIRE_MAX_STOP_STRINGS = 64
WIRE_MAX_STOP_STRING_CHARS = 1024
WIRE_MAX_STOP_TOKEN_IDS = 1024
WIRE_MAX_LOGIT_BIAS = 4096
# How deep a structured-output constraint may nest (JSON containers of a schema, brackets of a
# pattern or grammar), checked by the router (a 400) and the engine alike. Real schemas nest
# a few levels; a deep one only costs recursion in the grammar library (llguidance stops near
# 128 levels) and in whoever parses it.
MAX_GUIDED_NESTING = 64
_BRACKETS = re.compile(r'[\\"()\[\]{}]')


@dataclass(frozen=True, slots=True)
class GuidedDecoding:
    """Structured output: the tokens the sampler may pick are masked so the text matches
    `spec`. `kind` is one of `GUIDED_KINDS`; `spec` is the schema's JSON text
    ("json_schema"), the pattern ("regex"), a JSON list of strings ("choice"), the grammar
    ("grammar"), or empty ("json_object": any JSON object)."""

    kind: Annotated[str, MaxLen(32)]
    spec: Annotated[str, MaxLen(WIRE_MAX_GUIDED_SPEC_CHARS)] = ""


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """`temperature == 0` means greedy; `top_k == 0` and `top_p == 1` disable those filters;
    `logprobs`: None for none, 0 for the chosen token's, k for the top k too. Ranges are
    checked by the engine (`SamplingParams`), which refuses the request otherwise."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Annotated[list[Annotated[str, MaxLen(WIRE_MAX_STOP_STRING_CHARS)]],
                    MaxLen(WIRE_MAX_STOP_STRINGS)] = field(default_factory=list)
    stop_token_ids: Annotated[list[int], MaxLen(WIRE_MAX_STOP_TOKEN_IDS)] = field(
        default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Annotated[dict[int, float], MaxLen(WIRE_MAX_LOGIT_BIAS)] = field(
        default_factory=dict)
    guided: GuidedDecoding | None = None


def guided_nesting(kind: str, spec: str) -> int:
    """How deep `spec` nests: its brackets, outside string literals (JSON's and grammars'
    quoted literals; a regex has none) and escapes. A bracket in a regex's character class
    counts too: never less than the real depth."""
    quotes = kind != "regex"
    depth = deepest = 0
    in_string = False
    escaped_at = -1  # the position a backslash escapes
    for match in _BRACKETS.finditer(spec):
        char, at = match.group(), match.start()
        if at == escaped_at:
            continue
        if char == "\\":
            escaped_at = at + 1
        elif char == '"':
            in_string = quotes and not in_string
        elif not in_string:
            depth = depth + 1 if char in "([{" else max(0, depth - 1)
            deepest = max(deepest, depth)
    return deepest


def guided_nesting_error(kind: str, spec: str) -> str | None:
    """Why a constraint nests too deep (None: it does not)."""
    depth = guided_nesting(kind, spec)
    if depth <= MAX_GUIDED_NESTING:
        return None
    return (f"nests {depth} levels deep; the limit is {MAX_GUIDED_NESTING} "
            "(MAX_GUIDED_NESTING)")

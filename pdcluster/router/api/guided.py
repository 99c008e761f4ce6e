"""Structured output requests -> `core.sampling.GuidedDecoding`, the one field the node's
sampler masks tokens by. Four spellings reach it, and a request may use only one:
OpenAI's `response_format` (`text`, `json_object`, `json_schema`), vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`, and vLLM's newer `structured_outputs`
object (`json`, `regex`, `choice`, `grammar`, `json_object`). A constraint longer than
`MAX_SPEC_CHARS` or nesting deeper than `core.sampling.MAX_GUIDED_NESTING` is refused (400
naming the limit) before any node compiles it.

API: `parse_guided`, `json_schema_guide`.
"""

from __future__ import annotations

import json
from typing import Any

from pdcluster.core.sampling import GuidedDecoding, guided_nesting_error
from pdcluster.router.errors import ApiError

MAX_SPEC_CHARS = 64 << 10
_GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex",
                  "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_FIELDS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                      "grammar": "grammar", "json_object": "json_object"}


def parse_guided(body: dict) -> GuidedDecoding | None:
    """The request's structured-output constraint, or None; 400 naming the parameter for a
    malformed one or for two at once."""
    found: list[tuple[str, GuidedDecoding]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        guide = _response_format(response_format)
        if guide is not None:
            found.append(("response_format", guide))
    for name, kind in _GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append((name, _guide(kind, body[name], name)))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured(body["structured_outputs"])))
    if len(found) > 1:
        raise ApiError(400, "only one structured-output constraint per request, got "
                       f"{[name for name, _ in found]}", found[1][0], "invalid_value")
    return found[0][1] if found else None


def json_schema_guide(schema: dict, where: str) -> GuidedDecoding:
    return _guide("json_schema", schema, where)


def _response_format(value: Any) -> GuidedDecoding | None:
    where = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding("json_object", "")
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise ApiError(400, "response_format json_schema needs "
                           "{'json_schema': {'name': ..., 'schema': {...}}}", where,
                           "invalid_value")
        return _guide("json_schema", inner["schema"], where)
    raise ApiError(400, "response_format.type must be 'text', 'json_object' or "
                   f"'json_schema', got {kind!r}", where, "invalid_value")


def _structured(value: Any) -> GuidedDecoding:
    where = "structured_outputs"
    if not isinstance(value, dict):
        raise ApiError(400, f"'{where}' must be an object", where, "invalid_type")
    set_keys = [k for k, v in value.items() if v is not None and v is not False]
    unknown = set(set_keys) - set(_STRUCTURED_FIELDS)
    if unknown:
        raise ApiError(400, f"'{where}': unsupported keys {sorted(unknown)}", where,
                       "unsupported_parameter")
    if len(set_keys) != 1:
        raise ApiError(400, f"'{where}' needs exactly one of {sorted(_STRUCTURED_FIELDS)}",
                       where, "invalid_value")
    (key,) = set_keys
    if key == "json_object":
        return GuidedDecoding("json_object", "")
    return _guide(_STRUCTURED_FIELDS[key], value[key], f"{where}.{key}")


def _guide(kind: str, value: Any, where: str) -> GuidedDecoding:
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise ApiError(400, f"'{where}' is not valid JSON", where,
                               "invalid_value") from None
        if not isinstance(value, dict | bool):
            raise ApiError(400, f"'{where}' must be a JSON schema object", where,
                           "invalid_value")
        spec = json.dumps(value)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(
                isinstance(c, str) for c in value):
            raise ApiError(400, f"'{where}' must be a non-empty list of strings", where,
                           "invalid_value")
        spec = json.dumps(value)
    else:
        if not isinstance(value, str) or not value:
            raise ApiError(400, f"'{where}' must be a non-empty string", where,
                           "invalid_value")
        spec = value
    if len(spec) > MAX_SPEC_CHARS:
        raise ApiError(400, f"'{where}' is longer than {MAX_SPEC_CHARS} characters", where,
                       "invalid_value")
    too_deep = guided_nesting_error(kind, spec)
    if too_deep:
        raise ApiError(400, f"'{where}' {too_deep}", where, "invalid_value")
    return GuidedDecoding(kind, spec)

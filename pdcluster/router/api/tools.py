"""Tool calling for chat completions: the request's `tools` / `tool_choice` /
`parallel_tool_calls`, how the tools reach the prompt, and the model's output parsed back
into OpenAI `tool_calls`.

- `none` renders no tools and parses nothing. `auto` renders them and parses the output in
  the model family's format. `required` and a named function also set the guided field (a
  JSON schema built from the tools' parameter schemas, as vLLM does), so the node's sampler
  can only produce a valid call: for `required` a JSON list of `{"name", "parameters"}`, for a
  named function its arguments object.
- Rendering: a template that uses `tools` gets them (`RouterTokenizer.apply_chat_template`);
  one that does not (SmolLM2's, many small models') gets them in a Hermes-style system
  prompt, so the model is told about them either way.
- Formats (`tool_format`): "hermes" (`<tool_call>{"name", "arguments"}</tool_call>`: Hermes,
  Qwen2.5, SmolLM, and the fallback prompt) and "llama3_json" (`{"name", "parameters"}`,
  optionally after `<|python_tag|>`, several separated by `;`), picked from the template text.

API: `ToolChoice`, `parse_tools`, `tool_format`, `tools_prompt_messages`, `parse_tool_calls`,
`streamable_prefix`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pdcluster.core.sampling import GuidedDecoding
from pdcluster.router.api.guided import json_schema_guide
from pdcluster.router.errors import ApiError

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
_HERMES_OPEN = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FALLBACK_PROMPT = (
    "You may call one or more functions to assist with the user query. You are provided "
    "with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """`mode`: "none", "auto", "required" or "named" (`name` set). `guided`: the node's
    constraint for required / named."""

    mode: str
    name: str | None = None
    parallel: bool = True
    guided: GuidedDecoding | None = None


def parse_tools(body: dict) -> tuple[list[dict], ToolChoice | None]:
    """(the tools as `{"type": "function", "function": {...}}`, the choice); no tools and no
    choice -> ([], None). OpenAI's defaults: "auto" with tools, "none" without."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool | None):
        raise ApiError(400, "'parallel_tool_calls' must be a boolean", "parallel_tool_calls",
                       "invalid_type")
    tools = _tools(raw) if raw is not None else []
    if choice is None:
        return tools, (ToolChoice("auto", parallel=parallel is not False) if tools else None)
    mode, name = _choice(choice, tools)
    if mode == "required" and not tools:
        mode = "none"  # OpenAI: required with no tools behaves as none
    if mode == "none":
        return tools, ToolChoice("none")
    parallel = parallel is not False
    guided = _guided(mode, name, tools, parallel) if mode in ("required", "named") else None
    return tools, ToolChoice(mode, name, parallel, guided)


def _tools(raw: Any) -> list[dict]:
    if not isinstance(raw, list):
        raise ApiError(400, "'tools' must be a list", "tools", "invalid_type")
    tools, names = [], set()
    for i, tool in enumerate(raw):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type", "function") != "function"
                or not isinstance(function, dict)
                or not isinstance(function.get("name"), str) or not function["name"]):
            raise ApiError(400, f"tools[{i}] must be {{'type': 'function', 'function': "
                           "{'name': ..., 'parameters': {...}}}", "tools", "invalid_value")
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema "
                           "object", "tools", "invalid_value")
        if function["name"] in names:
            raise ApiError(400, f"two tools are named {function['name']!r}", "tools",
                           "invalid_value")
        names.add(function["name"])
        tools.append({"type": "function", "function": {
            k: function[k] for k in ("name", "description", "parameters") if k in function}})
    return tools


def _choice(choice: Any, tools: list[dict]) -> tuple[str, str | None]:
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools and choice != "required":
            raise ApiError(400, "tool_choice needs 'tools'", "tool_choice", "invalid_value")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":
        raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or "
                       "{'type': 'function', 'function': {'name': ...}}", "tool_choice",
                       "invalid_value")
    if name not in {t["function"]["name"] for t in tools}:
        raise ApiError(400, f"tool_choice names {name!r}, which is not in 'tools'",
                       "tool_choice", "invalid_value")
    return "named", name


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _guided(mode: str, name: str | None, tools: list[dict], parallel: bool
            ) -> GuidedDecoding:
    if mode == "named":
        (tool,) = [t for t in tools if t["function"]["name"] == name]
        return json_schema_guide(_parameters(tool), "tool_choice")
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {
            "name": {"type": "string", "enum": [t["function"]["name"]]},
            "parameters": _parameters(t)},
         "required": ["name", "parameters"], "additionalProperties": False}
        for t in tools]}}
    if not parallel:
        calls["maxItems"] = 1
    return json_schema_guide(calls, "tools")


def tool_format(template_source: str) -> str:
    """The family's call format, from the chat template's text."""
    if "<|python_tag|>" in template_source or "ipython" in template_source:
        return LLAMA3_JSON
    return HERMES


def tools_prompt_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The fallback for templates that ignore `tools`: the tools in a Hermes-style system
    prompt, ahead of (or merged into) the first system message."""
    listed = "\n".join(json.dumps(t) for t in tools)
    prompt = _FALLBACK_PROMPT.format(tools=listed)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{prompt}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def parse_tool_calls(text: str, choice: ToolChoice, fmt: str
                     ) -> tuple[str | None, list[dict]]:
    """(content left, OpenAI tool_calls) from the model's output. Text that is not a
    well-formed call stays content (and no call is made of it)."""
    if choice.mode == "named":
        args = _json(text)
        call = _call(choice.name, args, choice) if isinstance(args, dict) else None
        return (text, []) if call is None else (None, [call])
    if choice.mode == "required":
        calls = _json(text)
        if not isinstance(calls, list):
            return text, []
        parsed = [_call(c.get("name"), c.get("parameters"), choice) for c in calls
                  if isinstance(c, dict)]
        return None, [c for c in parsed if c is not None][:None if choice.parallel else 1]
    if fmt == LLAMA3_JSON:
        return _parse_llama3(text, choice)
    return _parse_hermes(text, choice)


def streamable_prefix(text: str, choice: ToolChoice, fmt: str) -> int:
    """How much of a choice's text so far can stream as content: everything before a call
    could start. required / named output is all call; Llama-3 JSON calls open the output;
    a Hermes call may open anywhere, so a tail that could begin `<tool_call>` is held."""
    if choice.mode != "auto":
        return 0
    if fmt == LLAMA3_JSON:
        head = text.lstrip()
        opens = not head or head.startswith("{") or _starts_marker(head, "<|python_tag|>")
        return 0 if opens else len(text)
    at = text.find(_HERMES_OPEN)
    if at != -1:
        return at
    for keep in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):
        if _HERMES_OPEN.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


def _starts_marker(text: str, marker: str) -> bool:
    return text.startswith(marker) or marker.startswith(text)


def _parse_hermes(text: str, choice: ToolChoice) -> tuple[str | None, list[dict]]:
    if _HERMES_OPEN not in text:
        return text, []
    calls = []
    for body in _HERMES_CALL.findall(text):
        obj = _json(body)
        call = (_call(obj.get("name"), obj.get("arguments", obj.get("parameters")), choice)
                if isinstance(obj, dict) else None)
        if call is None:
            return text, []  # a malformed call: the text is returned as it is
        calls.append(call)
    content = text[:text.index(_HERMES_OPEN)].strip() or None
    return content, calls[:None if choice.parallel else 1]


def _parse_llama3(text: str, choice: ToolChoice) -> tuple[str | None, list[dict]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    for part in body.split(";"):
        obj = _json(part)
        call = (_call(obj.get("name"), obj.get("parameters", obj.get("arguments")), choice)
                if isinstance(obj, dict) else None)
        if call is None:
            return text, []
        calls.append(call)
    return None, calls[:None if choice.parallel else 1]


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _call(name: Any, args: Any, choice: ToolChoice) -> dict | None:
    if not isinstance(name, str) or not isinstance(args, dict | None):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args or {})}}

"""Chat messages as the client sends them -> what the chat template renders: text content
(text parts joined), and the tool-calling fields (`tool_calls` with their arguments as
objects, `tool_call_id`, `name`). A malformed message is a 400 naming it.

API: `parse_message`.
"""

from __future__ import annotations

import json
from typing import Any

from pdcluster.router.errors import ApiError


def parse_message(message: Any, i: int) -> dict:
    """messages[i] as the chat template gets it (text parts joined, earlier tool calls
    and tool results kept)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(400, f"{where} must be an object with a string 'role'", where,
                       "invalid_value")
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"{where}.content: only text parts are supported", where,
                           "invalid_value")
        content = "".join(p["text"] for p in content)
    calls = message.get("tool_calls")
    if content is None and calls:
        content = ""  # an assistant turn that only called tools
    if not isinstance(content, str):
        raise ApiError(400, f"{where}.content must be a string", where, "invalid_type")
    out = {"role": message["role"], "content": content}
    if calls is not None:
        out["tool_calls"] = _tool_calls_in(calls, where)
    if isinstance(message.get("tool_call_id"), str):
        out["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _tool_calls_in(calls: Any, where: str) -> list[dict]:
    """An assistant message's earlier tool calls, for the template (arguments as objects,
    which is what templates print)."""
    if not isinstance(calls, list):
        raise ApiError(400, f"{where}.tool_calls must be a list", where, "invalid_type")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, f"{where}.tool_calls: each needs function.name", where,
                           "invalid_value")
        args = function.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            raise ApiError(400, f"{where}.tool_calls: arguments must be JSON", where,
                           "invalid_value") from None
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": args}})
    return out

"""Tool calling in the router: the tools reach the prompt (through the template or the
fallback system prompt), the model's output parses back into OpenAI tool_calls per family
format, and a scripted node's tool call comes out of the real HTTP API (`openai` client)."""

from __future__ import annotations

import json
import shutil

import openai

from pdcluster.router.api.tokenizer import RouterTokenizer
from pdcluster.router.api.tools import (
    HERMES,
    LLAMA3_JSON,
    ToolChoice,
    parse_tool_calls,
    tool_format,
    tools_prompt_messages,
)

AUTO = ToolChoice("auto")
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
TOOLS_TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};"
                  "{% endfor %}\n{% endif %}{% for m in messages %}{{ m.role }}: "
                  "{{ m.content }}\n{% endfor %}<tool_call>")


def test_hermes_calls_parse_with_content_before() -> None:
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '</tool_call>')
    content, calls = parse_tool_calls(text, AUTO, HERMES)
    assert content == "Let me check."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"},
                                                                       {"city": "Oslo"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    _, one = parse_tool_calls(text, ToolChoice("auto", parallel=False), HERMES)
    assert len(one) == 1


def test_malformed_or_absent_calls_stay_content() -> None:
    for text in ["just words", "<tool_call>{not json</tool_call>", '<tool_call>{"x": 1}']:
        assert parse_tool_calls(text, AUTO, HERMES) == (text, [])


def test_unterminated_final_hermes_call_parses() -> None:
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}', AUTO, HERMES)
    assert calls[0]["function"] == {"name": "f", "arguments": "{}"}


def test_llama3_json_calls() -> None:
    text = ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
            '{"name": "b", "parameters": {}}')
    content, calls = parse_tool_calls(text, AUTO, LLAMA3_JSON)
    assert content is None and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert parse_tool_calls("Hello there", AUTO, LLAMA3_JSON) == ("Hello there", [])


def test_required_and_named_parse_the_guided_json() -> None:
    required = ToolChoice("required")
    _, calls = parse_tool_calls('[{"name": "f", "parameters": {"a": 2}}]', required, HERMES)
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a": 2}'}
    _, calls = parse_tool_calls('{"city": "Rome"}', ToolChoice("named", "w"), HERMES)
    assert calls[0]["function"] == {"name": "w", "arguments": '{"city": "Rome"}'}


def test_format_is_picked_from_the_template() -> None:
    assert tool_format("{{ '<|python_tag|>' }} Environment: ipython") == LLAMA3_JSON
    assert tool_format("<tool_call>") == HERMES
    assert tool_format("") == HERMES


def test_fallback_prompt_lists_the_tools() -> None:
    messages = tools_prompt_messages([{"role": "user", "content": "hi"}], [TOOL])
    assert messages[0]["role"] == "system" and '"get_weather"' in messages[0]["content"]
    merged = tools_prompt_messages([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "hi"}], [TOOL])
    assert len(merged) == 2 and merged[0]["content"].startswith("Be brief.")


def test_a_template_with_tools_renders_them(model_dir, tmp_path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(model_dir, folder)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    tok = RouterTokenizer(folder)
    assert tok.template_uses_tools
    with_tools = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[TOOL])
    assert tok.decode(with_tools).startswith("TOOLS:get_weather;")
    assert not tok.decode(tok.apply_chat_template([{"role": "user", "content": "hi"}])) \
        .startswith("TOOLS")


def test_a_scripted_tool_call_comes_back_as_tool_calls(start_router, make_node,
                                                       model_dir) -> None:
    tok = RouterTokenizer(model_dir)
    script = tok.encode('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
                        '</tool_call>', add_special_tokens=False)
    node = make_node(script=script)
    router = start_router([node])
    client = openai.OpenAI(base_url=router.base_url, api_key="none", max_retries=0, timeout=10)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    out = client.chat.completions.create(model="tiny", messages=messages, tools=[TOOL],
                                         max_tokens=len(script))
    call = out.choices[0].message.tool_calls[0]
    assert out.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris"})
    prompt = tok.decode(node.requests()[0].prompt_token_ids)
    assert '"get_weather"' in prompt  # the fallback prompt told the model about it
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, tools=[TOOL],
                                                 max_tokens=len(script), stream=True))
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [tc.function.name for tc in calls] == ["get_weather"] and calls[0].index == 0
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = client.chat.completions.create(model="tiny", messages=messages, tools=[TOOL],
                                           tool_choice="none", max_tokens=len(script))
    assert plain.choices[0].message.tool_calls is None
    assert '"get_weather"' not in tok.decode(node.requests()[-1].prompt_token_ids)


def test_a_conversation_with_earlier_calls_reaches_the_template() -> None:
    from pdcluster.router.api.protocol import parse_chat

    req = parse_chat({"model": "m", "tools": [TOOL], "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    assistant, tool = req.messages[1], req.messages[2]
    assert assistant["content"] == "" and assistant["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": {"city": "Oslo"}}
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_streamable_prefix_holds_only_what_could_be_a_call() -> None:
    from pdcluster.router.api.tools import streamable_prefix

    assert streamable_prefix("Hello there", AUTO, HERMES) == 11
    assert streamable_prefix("Hello <tool", AUTO, HERMES) == 6
    assert streamable_prefix("Hi <tool_call>{", AUTO, HERMES) == 3
    assert streamable_prefix("a < b", AUTO, HERMES) == 5
    assert streamable_prefix(' {"name"', AUTO, LLAMA3_JSON) == 0
    assert streamable_prefix("Sure", AUTO, LLAMA3_JSON) == 4
    assert streamable_prefix("anything", ToolChoice("required"), HERMES) == 0


def test_content_streams_before_a_call_and_plain_answers_stream(start_router, make_node,
                                                                  model_dir) -> None:
    tok = RouterTokenizer(model_dir)
    said = "Sure, checking now."
    script = tok.encode(said + '<tool_call>{"name": "get_weather", "arguments": {}}'
                        '</tool_call>', add_special_tokens=False)
    router = start_router([make_node(script=script)])
    client = openai.OpenAI(base_url=router.base_url, api_key="none", max_retries=0, timeout=10)
    messages = [{"role": "user", "content": "Weather?"}]
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, tools=[TOOL],
                                                 max_tokens=len(script), stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = [d.content for d in deltas if d.content]
    assert "".join(content) == said and len(content) > 1  # streamed, not held to the end
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert [tc.function.name for tc in calls] == ["get_weather"]
    plain_script = tok.encode("It is sunny in Paris today.", add_special_tokens=False)
    router2 = start_router([make_node("n2", script=plain_script)])
    client2 = openai.OpenAI(base_url=router2.base_url, api_key="none", max_retries=0,
                            timeout=10)
    chunks = list(client2.chat.completions.create(
        model="tiny", messages=messages, tools=[TOOL], max_tokens=len(plain_script),
        stream=True))
    content = [c.choices[0].delta.content for c in chunks if c.choices and
               c.choices[0].delta.content]
    assert "".join(content) == "It is sunny in Paris today." and len(content) > 2
    assert chunks[-1].choices[0].finish_reason == "length"

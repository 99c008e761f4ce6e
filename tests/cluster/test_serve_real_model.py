"""`pdcluster serve` with the real model (SmolLM2-135M-Instruct): a real process tree on
127.0.0.1 called with the `openai` client. One cluster serves both paths: short chats stay
under `--local-prefill-threshold` and the decode node prefills them itself; the same
questions behind a long system prompt, each with its own cache salt (no prefix hits), go
through the prefill node and arrive over Mooncake. Every reply must equal transformers'
greedy reply, and the router's metrics must show the path taken."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from pdcluster.benchmarks.ports import free_port
from tests.cluster.test_serve_e2e import decisions
from tests.real_model import LONG_SYSTEM, MAX_TOKENS, chats
from tests.serve_process import start_serve, stop_serve, wait_until_answering

pytestmark = pytest.mark.slow
THRESHOLD = 64  # tokens; the short chats are ~40, the long ones ~130


@pytest.fixture(scope="module")
def served_real(real_model_dir):
    port = free_port()
    proc, _ = start_serve(["--model", real_model_dir, "--num-prefill", "1", "--num-decode",
                           "1", "--port", str(port), "--kv-cache-gib", "0.25",
                           "--local-prefill-threshold", str(THRESHOLD)], timeout_s=240)
    try:
        name = Path(real_model_dir).name
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=180)
        wait_until_answering(client, name, timeout_s=240)
        yield client, port, name
    finally:
        stop_serve(proc)


@pytest.mark.parametrize("path", ["local_prefill", "remote_prefill"])
def test_chats_equal_transformers(served_real, real_reference, path):
    client, port, name = served_real
    conversations = chats() if path == "local_prefill" else chats(LONG_SYSTEM)
    before = decisions(port, f'reason="{path}",role="decode"')
    for i, messages in enumerate(conversations):
        assert (len(real_reference.chat_ids(messages)) > THRESHOLD) == (path != "local_prefill")
        reply = client.chat.completions.create(
            model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"cache_salt": f"{path}-{i}"})
        assert reply.choices[0].message.content == real_reference.answer(messages), messages
    assert decisions(port, f'reason="{path}",role="decode"') - before == len(conversations)


def test_answers_the_capital_of_france(served_real):
    client, _, name = served_real
    reply = client.chat.completions.create(
        model=name, max_tokens=32, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"



@pytest.mark.parametrize("penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                                     {"repetition_penalty": 2.0}],
                         ids=["presence", "frequency", "repetition"])
def test_penalties_change_a_repetitive_completion(served_real, penalty):
    """Needs the node's sampler to apply the penalties (engine side)."""
    client, _, name = served_real
    prompt = "apple, banana, " * 12
    plain = client.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0)
    words = plain.choices[0].text.split()
    assert len(set(words)) < len(words) / 2  # greedy goes on repeating the pattern
    penalised = client.completions.create(model=name, prompt=prompt, max_tokens=24,
                                          temperature=0, extra_body=penalty)
    assert penalised.choices[0].text != plain.choices[0].text

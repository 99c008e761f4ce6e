"""`pdcluster serve` with the real model (SmolLM2-135M-Instruct): a real process tree on
127.0.0.1 called with the `openai` client. One cluster serves both paths: short chats stay
under `--local-prefill-threshold` and the decode node prefills them itself; the same
questions behind a long system prompt, each with its own cache salt (no prefix hits), go
through the prefill node and arrive over Mooncake. Every reply must equal transformers'
greedy reply, and the router's metrics must show the path taken."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.test_serve_e2e import decisions, free_port
from tests.real_model import LONG_SYSTEM, MAX_TOKENS, chats

openai = pytest.importorskip("openai")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
THRESHOLD = 64  # tokens; the short chats are ~40, the long ones ~130


@pytest.fixture(scope="module")
def served_real(real_model_dir):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--model", real_model_dir,
         "--num-prefill", "1", "--num-decode", "1", "--port", str(port),
         "--kv-cache-gib", "0.25", "--local-prefill-threshold", str(THRESHOLD)],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        client = _wait_until_serving(proc, port, Path(real_model_dir).name)
        yield client, port, Path(real_model_dir).name
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_until_serving(proc, port: int, name: str):
    deadline = time.monotonic() + 240
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "serving" in line or time.monotonic() > deadline:
            break
    assert "serving" in "".join(lines[-1:]), "".join(lines[-40:])
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           max_retries=0, timeout=180)
    while True:
        try:
            client.completions.create(model=name, prompt="warm up", max_tokens=1)
            return client
        except openai.APIStatusError as exc:
            if exc.status_code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


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

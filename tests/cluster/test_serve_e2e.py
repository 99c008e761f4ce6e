"""`pdcluster serve` end to end: a real process tree on 127.0.0.1 (local Ray, a prefill and a
decode node actor, the metadata service, the router), called with the real `openai` client.
Greedy text must equal what `transformers` generates for the same prompt."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from pdcluster.benchmarks.ports import free_port
from tests.serve_process import start_serve, stop_serve, wait_until_answering


@pytest.fixture(scope="module")
def served(model_dirs):
    port = free_port()
    proc, _ = start_serve(["--model", model_dirs["llama-gqa"], "--num-prefill", "1",
                           "--num-decode", "1", "--port", str(port), "--block-size", "16",
                           "--kv-cache-gib", "0.05", "--local-prefill-threshold", "256"])
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           max_retries=0, timeout=120)
    wait_until_answering(client, Path(model_dirs["llama-gqa"]).name)
    proc.port = port
    yield proc, client
    if not stop_serve(proc):
        raise TimeoutError("pdcluster serve did not exit within 60 s of SIGINT")


def hf_text(model_dir: str, prompt: str, max_tokens: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([tok(prompt).input_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("words", [20, 400], ids=["local-prefill", "disaggregated"])
def test_completion_matches_transformers(served, model_dirs, words):
    _, client = served
    model_dir = model_dirs["llama-gqa"]
    prompt = " ".join(f"word{i % 37} and" for i in range(words))
    out = client.completions.create(model=Path(model_dir).name, prompt=prompt, max_tokens=12,
                                    temperature=0)
    assert out.choices[0].text == hf_text(model_dir, prompt, 12)
    assert out.usage.completion_tokens >= 1
    reason = "remote_prefill" if words > 100 else "local_prefill"
    assert decisions(served[0].port, reason) >= 1, f"no {reason} decision in the router metrics"


def decisions(port: int, reason: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("router_routing_decisions_total") and reason in line)


def test_streaming_chat(served, model_dirs):
    _, client = served
    stream = client.chat.completions.create(
        model=Path(model_dirs["llama-gqa"]).name, stream=True, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "Tell me about Ray. " * 30}],
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_unknown_model_is_a_clear_404(served):
    _, client = served
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)


def _http(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(method, path, body=None if body is None else json.dumps(body),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = json.loads(response.read())
    conn.close()
    return response.status, payload


def test_tokenize_round_trip_and_edge_errors(served, model_dirs):
    """/tokenize gives the ids the nodes are served (same count as a completion's usage),
    /detokenize gives the text back; /health says it can serve; unknown routes and wrong
    methods are OpenAI errors."""
    from transformers import AutoTokenizer

    proc, client = served
    model_dir = model_dirs["llama-gqa"]
    name, prompt = Path(model_dir).name, "The capital of France is"
    status, out = _http(proc.port, "POST", "/tokenize", {"model": name, "prompt": prompt})
    assert status == 200 and out["tokens"] == AutoTokenizer.from_pretrained(model_dir)(
        prompt)["input_ids"]
    completion = client.completions.create(model=name, prompt=prompt, max_tokens=2,
                                           temperature=0)
    by_ids = client.completions.create(model=name, prompt=out["tokens"], max_tokens=2,
                                       temperature=0)
    assert completion.usage.prompt_tokens == by_ids.usage.prompt_tokens == out["count"]
    assert by_ids.choices[0].text == completion.choices[0].text
    status, text = _http(proc.port, "POST", "/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and text["prompt"].endswith(prompt)
    status, health = _http(proc.port, "GET", "/health")
    assert status == 200 and health["reason"] is None
    assert {n["role"] for n in health["nodes"].values() if n["healthy"]} >= {"decode"}
    assert _http(proc.port, "GET", "/v1/nothing")[1]["error"]["code"] == "not_found"
    assert _http(proc.port, "GET", "/v1/chat/completions")[0] == 405
    assert _http(proc.port, "GET", "/version")[0] == 200

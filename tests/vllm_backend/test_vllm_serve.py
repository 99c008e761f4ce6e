"""`pdcluster serve --engine vllm` with the real model (SmolLM2-135M-Instruct): the whole cluster
(local Ray, a prefill and a decode node running vLLM, the metadata service, the router) called
with the `openai` client. Replies equal vLLM's own offline `LLM` token for token on both paths
(the router's metrics show which: short chats are prefilled by the decode node itself, long ones
arrive from the prefill node over Mooncake), streaming and not; logprobs and structured output
go through vLLM's own support; a cached prefix is routed to and hit; no vLLM block is held
once the requests are done."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make setup-vllm)")

from pdcluster.benchmarks.ports import free_port
from pdcluster.core.credentials import SERVICE, ClusterSecret
from tests.cluster.test_serve_e2e import decisions
from tests.real_model import LONG_SYSTEM, MAX_TOKENS, chats
from tests.serve_process import start_serve, stop_serve, wait_until_answering

pytestmark = pytest.mark.slow
THRESHOLD = 64  # tokens: the short chats are ~40, the long ones ~130
BLOCK = 32
OFFLINE = Path(__file__).with_name("offline_reference.py")


class Served:
    def __init__(self, proc, port: int, name: str, metadata: str, secret: ClusterSecret):
        self.proc, self.port, self.name = proc, port, name
        self.metadata, self.secret = metadata, secret
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                    max_retries=0, timeout=300)

    def node_metrics(self) -> dict[str, str]:
        """node id -> its Prometheus text (addresses from the metadata service)."""
        from pdcluster.metadata_service.client import MetadataClient

        with MetadataClient(self.metadata, token=self.secret.metadata_token(SERVICE)) as c:
            nodes = {n.node_id: n.metrics_address for n in c.list_nodes()}
        return {node: urllib.request.urlopen(address, timeout=10).read().decode()
                for node, address in nodes.items()}


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def served(real_model_dir, tmp_path_factory):
    port, secret = free_port(), ClusterSecret.generate()
    env = {**os.environ, "PDCLUSTER_CLUSTER_SECRET": secret.to_text(),
           "VLLM_LOGGING_LEVEL": "WARNING"}
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc, ready = start_serve(
        ["--engine", "vllm", "--model", real_model_dir, "--num-prefill", "1",
         "--num-decode", "1", "--port", str(port), "--kv-cache-gib", "0.25",
         "--local-prefill-threshold", str(THRESHOLD), "--node-metrics-port", "0"],
        env, timeout_s=900, log_path=log)
    try:
        metadata = re.search(r"metadata service at (\S+?)\)", ready).group(1)
        served = Served(proc, port, Path(real_model_dir).name, metadata, secret)
        wait_until_answering(served.client, served.name, timeout_s=300)
        yield served
    finally:
        stop_serve(proc)


class OfflineReplies:
    """Reply text by vLLM's offline `LLM` for every chat of the module, keyed by chat: computed
    by offline_reference.py in a process of its own, started at once so that it runs while the
    cluster starts, and waited for at the first lookup. vLLM's engine core runs inside that
    process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the same model runner, without the two
    processes that would each import vLLM again."""

    def __init__(self, model_dir: str, reference, folder: Path) -> None:
        self.conversations = chats() + chats(LONG_SYSTEM)
        self.reference, self.folder = reference, folder
        job = {"prompts": [reference.chat_ids(m) for m in self.conversations],
               "max_tokens": MAX_TOKENS, "block_size": BLOCK}
        (folder / "in.json").write_text(json.dumps(job))
        self.log = (folder / "offline.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(OFFLINE), model_dir, str(folder / "in.json"),
             str(folder / "out.json")], cwd=folder, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                 "VLLM_LOGGING_LEVEL": "WARNING"})
        self._replies: dict[str, str] | None = None

    def __getitem__(self, key: str) -> str:
        if self._replies is None:
            self._replies = self._wait()
        return self._replies[key]

    def _wait(self) -> dict[str, str]:
        returncode = self.proc.wait(timeout=900)
        self.log.close()
        assert returncode == 0, (self.folder / "offline.log").read_text()[-4000:]
        tokens = json.loads((self.folder / "out.json").read_text())["tokens"]
        eos = self.reference.eos_token_id
        return {json.dumps(m): self.reference.tokenizer.decode(
            t[:t.index(eos)] if eos in t else t, skip_special_tokens=True)
            for m, t in zip(self.conversations, tokens, strict=True)}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def vllm_offline(real_model_dir, real_reference, tmp_path_factory):
    """Requested before `served` by the tests that use both: the reference runs meanwhile."""
    replies = OfflineReplies(real_model_dir, real_reference, tmp_path_factory.mktemp("offline"))
    yield replies
    replies.stop()


@pytest.mark.parametrize("path", ["local_prefill", "remote_prefill"])
def test_chats_equal_vllm_offline(vllm_offline, served, path) -> None:
    conversations = chats() if path == "local_prefill" else chats(LONG_SYSTEM)
    before = decisions(served.port, f'reason="{path}",role="decode"')
    for i, messages in enumerate(conversations):
        reply = served.client.chat.completions.create(
            model=served.name, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"cache_salt": f"{path}-{i}"})  # no prefix hits between them
        assert reply.choices[0].message.content == vllm_offline[json.dumps(messages)]
    assert decisions(served.port, f'reason="{path}",role="decode"') - before \
        == len(conversations)


def test_streaming_equals_vllm_offline(vllm_offline, served) -> None:
    messages = chats(LONG_SYSTEM)[2]
    stream = served.client.chat.completions.create(
        model=served.name, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        stream=True, extra_body={"cache_salt": "stream"})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == vllm_offline[json.dumps(messages)]


def test_answers_the_capital_of_france(served) -> None:
    reply = served.client.chat.completions.create(
        model=served.name, max_tokens=32, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"


def test_logprobs_and_structured_output_through_vllm(served) -> None:
    out = served.client.completions.create(model=served.name, prompt="The sky is",
                                           max_tokens=4, temperature=0, logprobs=3)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == 4 and all(len(t) == 3 for t in logprobs.top_logprobs)
    for token, lp, top in zip(logprobs.tokens, logprobs.token_logprobs,
                              logprobs.top_logprobs, strict=True):
        assert max(top.values()) == pytest.approx(lp, abs=1e-4), (token, top)  # greedy
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    reply = served.client.chat.completions.create(
        model=served.name, max_tokens=40, temperature=0,
        messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema}})
    assert set(json.loads(reply.choices[0].message.content)) == {"city"}


def test_a_cached_prefix_is_routed_to_and_hit(served) -> None:
    first, second = chats(LONG_SYSTEM)[0], chats(LONG_SYSTEM)[1]
    salt = {"cache_salt": "shared-prefix"}
    served.client.chat.completions.create(model=served.name, messages=first, max_tokens=4,
                                          temperature=0, extra_body=salt)
    router_before = _router_hits(served.port)
    nodes_before = {n: metric(t, "pdcluster_node_prefix_hit_tokens") for n, t in
                    served.node_metrics().items()}
    served.client.chat.completions.create(model=served.name, messages=second, max_tokens=4,
                                          temperature=0, extra_body=salt)
    # the system prompt's blocks (~90 tokens: 2 of 32) were found in the index ...
    assert _router_hits(served.port) - router_before >= 2 * BLOCK
    deadline = time.monotonic() + 10
    while True:  # ... and vLLM's own prefix cache counted them on the node it went to
        gained = sum(metric(t, "pdcluster_node_prefix_hit_tokens") - nodes_before[n]
                     for n, t in served.node_metrics().items())
        if gained >= 2 * BLOCK or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert gained >= 2 * BLOCK


def test_no_vllm_block_is_held_once_requests_are_done(served) -> None:
    deadline = time.monotonic() + 15
    while True:
        used = {n: metric(t, "pdcluster_node_kv_blocks", state="used")
                for n, t in served.node_metrics().items()}
        if len(used) == 2 and not any(used.values()):
            return
        assert time.monotonic() < deadline, f"blocks in use: {used}"
        time.sleep(0.5)


def _router_hits(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return metric(text, "router_prefix_hit_tokens_total")


def test_generate_with_vllm_from_another_folder(real_model_dir, real_reference, vllm_offline,
                                                tmp_path) -> None:
    """`pdcluster generate --engine vllm`: the same engine a vLLM node runs, alone, from a
    folder outside the checkout."""
    messages = chats()[0]
    ids = ",".join(map(str, real_reference.chat_ids(messages)))
    pdcluster = Path(sys.executable).with_name("pdcluster")
    proc = subprocess.run([str(pdcluster), "generate", "--engine", "vllm", "--model",
                           real_model_dir, "--prompt-ids", ids, "--max-tokens", str(MAX_TOKENS)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout.split("output: ", 1)[1].rstrip("\n")
    assert output == vllm_offline[json.dumps(messages)]

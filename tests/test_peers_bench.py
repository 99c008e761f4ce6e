"""`pdcluster bench peers` with the peer engine faked at the subprocess boundary: the fake
"venv" python runs the real driver (benchmarks/peers_driver.py, its line protocol and the shared
workload timing) with a stand-in engine, so nothing is installed. pdcluster (in its own process,
through the same driver) and transformers run for real on a tiny random model; their greedy
tokens must agree."""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import pytest

from pdcluster.benchmarks import peers_bench, peers_process, peers_report
from pdcluster.benchmarks.peers_workloads import PeerSizes

ROOT = Path(__file__).resolve().parents[1]
TINY = PeerSizes(num_requests=2, prompt_len=8, output_len=3, decode_prompt_len=8,
                 decode_tokens=2, ttft_prompt_len=24, shared_prefix_len=16, repeats=2,
                 hf_requests=1)

FAKE_DRIVER = """
import os
import sys
import time
sys.path.insert(0, {root!r})
from pdcluster.benchmarks import peers_driver

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


def test_cli_bench_peers_flags(monkeypatch, capsys) -> None:
    from pdcluster.cluster import cli

    module = types.ModuleType("pdcluster.benchmarks.peers_bench")
    module.run = lambda args: {"threads": args.threads, "llama_cpp": args.llama_cpp,
                               "install": args.install_llama_cpp}
    monkeypatch.setitem(sys.modules, "pdcluster.benchmarks.peers_bench", module)
    assert cli.main(["bench", "peers", "--json", "--llama-cpp"]) == 0
    assert json.loads(capsys.readouterr().out) == {"threads": 2, "llama_cpp": True,
                                                   "install": False}

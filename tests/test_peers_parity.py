"""The parity parts of the peer comparison (`python -m benchmarks peers`): one settings object
translated for every engine (benchmarks/peers_settings.py), the load gate and monitor and the
read bandwidth (benchmarks/peers_machine.py), the spread and paired ratios of the report."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import peers_machine, peers_settings
from benchmarks.peers_machine import LoadGate, LoadMonitor, own_running_threads
from benchmarks.peers_report import paired_ratios, spread
from benchmarks.peers_settings import PeerSettings
from pdcluster.cluster.cli_common import UsageError
from pdcluster.engine.config import EngineConfig

SETTINGS = PeerSettings(threads=2, max_num_batched_tokens=1024, max_num_seqs=8, kv_cache_gib=3,
                        max_model_len=600)


def test_pdcluster_launch_is_a_valid_engine_config_with_every_setting() -> None:
    launch = SETTINGS.launch("pdcluster", "/m")
    config = EngineConfig(**launch.options)  # an unknown option would raise here
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.kv_cache_memory_gib,
            config.max_model_len, config.dtype, config.device) == (1024, 8, 3.0, 600,
                                                                   "float32", "cpu")
    assert launch.sampling == {"detokenize": False}
    assert launch.env["OMP_NUM_THREADS"] == "2"


def test_vllm_launch_carries_the_same_settings(tmp_path: Path, monkeypatch) -> None:
    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    tcmalloc.touch()
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    iomp = tmp_path / "venv" / "lib" / "libiomp5.so"
    iomp.touch()
    monkeypatch.setattr(peers_settings, "TCMALLOC", tcmalloc)
    launch = SETTINGS.launch("vllm", "/m", venv=tmp_path / "venv")
    assert launch.options == {"model": "/m", "dtype": "float32", "seed": 0, "max_num_seqs": 8,
                              "max_num_batched_tokens": 1024, "max_model_len": 600,
                              "enable_prefix_caching": True}
    assert launch.sampling == {"detokenize": False}
    assert launch.env == {"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                          "VLLM_CPU_KVCACHE_SPACE": "3", "LD_PRELOAD": f"{tcmalloc}:{iomp}"}
    no_preload = PeerSettings(preload=False).launch("vllm", "/m", venv=tmp_path / "venv")
    assert "LD_PRELOAD" not in no_preload.env
    assert "LD_PRELOAD" not in PeerSettings(preload=False).launch("pdcluster", "/m").env


def test_preload_is_skipped_where_the_library_is_missing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(peers_settings, "TCMALLOC", tmp_path / "absent.so")
    assert "LD_PRELOAD" not in SETTINGS.launch("vllm", "/m", venv=tmp_path).env
    assert "LD_PRELOAD" not in SETTINGS.launch("pdcluster", "/m").env


def test_llamacpp_and_hf_launches() -> None:
    llama = SETTINGS.launch("llamacpp", "/m", gguf="/m.gguf")
    assert llama.options == {"model_path": "/m.gguf", "n_threads": 2, "n_threads_batch": 2,
                             "n_ctx": 600, "n_batch": 512}
    assert SETTINGS.launch("hf", "/m").options == {"model": "/m", "dtype": "float32",
                                                   "threads": 2}


@pytest.mark.parametrize("change, message", [
    ({"threads": 0}, "threads must be >= 1"),
    ({"dtype": "bfloat16"}, "float32 runs only"),
    ({"detokenize": True}, "detokenize must stay off"),
    ({"kv_cache_gib": 0}, "kv_cache_gib must be >= 1"),
])
def test_settings_refuse_what_the_bench_cannot_compare(change, message) -> None:
    with pytest.raises(ValueError, match=message):
        PeerSettings(**change)
    with pytest.raises(ValueError, match="unknown engine"):
        SETTINGS.launch("tgi", "/m")


def test_load_gate_waits_then_refuses_or_flags() -> None:
    loads = iter([3.0, 2.5, 2.0, 1.5])
    slept: list[float] = []
    gate = LoadGate(max_load=1.0, wait_s=10.0)
    with pytest.raises(UsageError, match=r"machine busy: 1-minute load average 2\.00 > 1\.00"):
        gate.check(loadavg=lambda: (next(loads),), sleep=slept.append, poll_s=5.0)
    assert slept == [5.0, 5.0]  # waited its 10 s, polling
    quiet = iter([3.0, 0.4])
    seen = LoadGate(1.0, wait_s=60.0).check(loadavg=lambda: (next(quiet),), sleep=lambda s: None)
    assert seen == {"load_avg_1m_at_start": 0.4, "max_load": 1.0, "waited_s": 5.0,
                    "busy_at_start": False}
    flagged = LoadGate(1.0, allow_busy=True).check(loadavg=lambda: (4.0,))
    assert flagged["busy_at_start"] is True
    assert LoadGate.for_threads(os.cpu_count(), None, 0, False).max_load == 0.5


def _spin(python_code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", python_code])


def test_own_running_threads_counts_descendants() -> None:
    child = _spin("while True: pass")
    try:
        time.sleep(0.5)
        # this thread (reading /proc) and the spinning child are both runnable
        assert own_running_threads() >= 2
    finally:
        child.kill()
        child.wait()


def _until_spinning(pid: int, timeout_s: float = 30.0) -> None:
    """Wait until `pid` has spent 0.3 s of CPU in user mode: its loop is running."""
    ticks = os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        utime = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11])
        if utime >= 0.3 * ticks:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} never spun")


def test_monitor_flags_a_window_while_another_process_spins() -> None:
    """A spinner outside the bench's process tree: started by a launcher that exits, so it is
    re-parented away from this process."""
    launcher = subprocess.run(
        [sys.executable, "-c", "import subprocess, sys\n"
         "p = subprocess.Popen([sys.executable, '-c', 'while True: pass'],"
         " start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
         "print(p.pid)"],
        capture_output=True, text=True, check=True, timeout=30)
    pid = int(launcher.stdout)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        assert int(stat[1]) != os.getpid()  # not our child
        _until_spinning(pid)  # not still starting its interpreter (sleeping on disk reads)
        with LoadMonitor(interval_s=0.1) as monitor:
            time.sleep(1.5)
            window = monitor.window()
        assert window["samples"] >= 5
        # the spinner uses a core whatever instants the runnable count happens to sample
        assert window["other_cpu_cores"] >= 0.7 and window["busy"]
    finally:
        os.kill(pid, signal.SIGKILL)


def test_monitor_does_not_count_the_bench_s_own_work() -> None:
    child = _spin("while True: pass")
    try:
        _until_spinning(child.pid)
        with LoadMonitor(interval_s=0.1) as monitor:
            time.sleep(1.5)
            window = monitor.window()
        assert window["other_cpu_cores"] < 0.3, window
    finally:
        child.kill()
        child.wait()


def test_machine_limits_measure_read_bandwidth_beside_copy() -> None:
    limits = peers_machine.machine_limits(1, matmul_n=128, stream_mib=64)
    assert set(limits) == {"matmul_gflops", "copy_gb_per_s", "read_gb_per_s"}
    # A copy moves every byte twice (read + write) and counts it once; a sum reads it once.
    assert limits["read_gb_per_s"] > limits["copy_gb_per_s"]


def test_spread_and_paired_ratios() -> None:
    ours = [{"w2_ms_per_token": 10.0}, {"w2_ms_per_token": 12.0}, {"w2_ms_per_token": 20.0}]
    theirs = [{"w2_ms_per_token": 10.0}, {"w2_ms_per_token": 8.0}, {"w2_ms_per_token": 25.0}]
    assert spread(ours) == {"w2_ms_per_token": {"min": 10.0, "max": 20.0, "rel_spread": 0.833}}
    assert paired_ratios(ours, theirs) == {"w2_decode_ms": {"median": 1.0, "min": 0.8,
                                                            "max": 1.5}}

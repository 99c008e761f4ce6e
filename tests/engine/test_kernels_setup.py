"""Setup's side of the engine's kernels (engine/kernels): the build falls back to portable flags
where the machine's own do not compile, the engine takes its torch paths with the same tokens
where the library is missing, broken or turned off (and logs why), and the GEMM calibration is
recorded, read back, and measured again when its record is bad."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdcluster.engine import kernels
from pdcluster.engine.kernels import __main__ as kernels_setup
from pdcluster.engine.kernels import gemm
from pdcluster.engine.models import attention
from tests.helpers import count_calls

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_ops():
    """`kernels.ops()` re-decided inside the test and again after it."""
    kernels.ops.cache_clear()
    yield
    kernels.ops.cache_clear()


def _generate(model_dir: str, prompts, max_tokens: int = 10):
    from pdcluster.engine import LLM, SamplingParams

    llm = LLM(model_dir, num_kv_blocks=128, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params)]


def test_without_the_library_the_engine_takes_its_torch_paths(model_dirs, hf_reference, tmp_path,
                                                              monkeypatch, caplog,
                                                              fresh_ops) -> None:
    """A machine where the build failed: the reason is logged, the torch paths run, and the
    greedy tokens are transformers' (as the kernels' are, test_kernels.py)."""
    from tests.models import random_prompts

    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(tmp_path))  # nothing built there
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        assert kernels.ops() is None
    assert "not built for this machine" in caplog.text
    calls = count_calls(monkeypatch, attention, "_batched_decode_attention")
    model, prompts = model_dirs["llama-gqa"], random_prompts(3, 3, 20, seed=3)
    got = _generate(model, prompts)
    assert calls, "the torch decode attention did not run"
    assert got == [hf_reference(model, prompt, 10) for prompt in prompts]


def test_a_library_that_does_not_load_is_logged_and_skipped(tmp_path, monkeypatch, caplog,
                                                            fresh_ops) -> None:
    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(tmp_path))
    kernels.library_path().parent.mkdir(parents=True)
    kernels.library_path().write_bytes(b"not a shared library")
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert kernels.ops() is None
    assert "do not load" in caplog.text and "torch paths" in caplog.text


def test_the_kernels_turn_off_through_the_environment(monkeypatch, fresh_ops) -> None:
    monkeypatch.setenv(kernels.DISABLE_ENV, "0")
    assert kernels.ops() is None
    assert kernels.ops_for(torch.zeros(1)) is None


def test_a_failing_compiler_is_reported_not_raised(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # exists, always fails
    assert kernels_setup.main() == 1
    err = capsys.readouterr().err
    assert "building the engine's kernels failed" in err and "torch paths" in err
    for isa in kernels.isa_choices():  # every flag set was tried
        assert f"[{' '.join(isa) or 'no ISA flags'}]" in err
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert kernels_setup.main() == 1
    assert "no C++ compiler" in capsys.readouterr().err
    assert not kernels.library_path().exists()


@pytest.mark.parametrize("flags, expected", [
    ("flags : fpu sse2 avx avx2 fma f16c", [("-march=native",), ("-mavx2", "-mfma"), ()]),
    ("flags : fpu sse2 avx avx2 fma avx512f avx512bw",
     [("-march=native",), ("-mavx2", "-mfma"), ()]),
    ("flags : fpu sse2 avx", [("-march=native",), ()]),  # no AVX2: straight to scalar
])
def test_the_flag_choices_follow_the_cpu(flags, expected) -> None:
    assert kernels.isa_choices(flags) == expected


@pytest.mark.slow
def test_a_compiler_that_rejects_the_machine_flags_gets_the_scalar_build(
        tmp_path, monkeypatch, caplog) -> None:
    """An old compiler that knows neither -march=native for this CPU nor -mavx2: setup still
    builds (the scalar paths), and the kernels' own tests pass against that build."""
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    cxx = tmp_path / "old-g++"
    cxx.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in -march=native|-mavx2)\n'
                   '  echo "old-g++: $a: unknown" >&2; exit 1;; esac; done\nexec g++ "$@"\n')
    cxx.chmod(0o755)
    cache = tmp_path / "cache"
    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(cache))
    monkeypatch.setenv("CXX", str(cxx))
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        path = kernels.build()
    assert path.is_file() and cache in path.parents
    assert caplog.text.count("failed; trying the next flags") == len(kernels.isa_choices()) - 1
    env = {**os.environ, "PDCLUSTER_CACHE_DIR": str(cache), "CXX": str(cxx)}
    tests = ("paged_attention_equals or gemv or rms_norms or rope_and_cache"
             " or matches_transformers and llama-gqa")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/engine/test_kernels.py", "-k", tests], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout


def test_gemm_calibration_records_a_winner_per_use(tmp_path, monkeypatch) -> None:
    from pdcluster.engine.kernels import gemm

    if not gemm._onednn_available():
        pytest.skip("torch built without oneDNN: nothing to choose")
    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(tmp_path))
    gemm.choice.cache_clear()
    try:
        assert gemm.choice() == gemm.DEFAULT  # nothing recorded: oneDNN
        record = gemm.calibrate_if_needed()
        assert gemm.choice_path().is_file() and gemm.choice_path().parent == tmp_path / "kernels"
        for use in gemm.USES:
            times = {b: record["seconds"][f"{use}/{b}"] for b in gemm.BACKENDS}
            assert record[use] == min(times, key=times.get) and all(t > 0 for t in times.values())
        assert gemm.choice() == {use: record[use] for use in gemm.USES}
        assert gemm.calibrate_if_needed() == record  # once per machine: read back, not re-run
        gemm.choice_path().write_text('{"linear": "cublas", "swiglu": "torch"}')
        gemm.choice.cache_clear()
        assert gemm.choice() == {"linear": "onednn", "swiglu": "torch"}  # unknown -> default
    finally:
        gemm.choice.cache_clear()


@pytest.mark.parametrize("picked", ["onednn", "torch"])
def test_linear_follows_the_calibration(picked, monkeypatch) -> None:
    import torch.nn.functional as F

    from pdcluster.engine.kernels import gemm
    from pdcluster.engine.models import linear as linear_mod

    if not linear_mod._ONEDNN:
        pytest.skip("torch built without oneDNN")
    monkeypatch.setattr(gemm, "choice", lambda: {"linear": picked, "swiglu": picked})
    monkeypatch.setattr(kernels, "ENABLED", False)
    onednn_calls = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def __call__(self, *args):
            onednn_calls.append(args[3])
            return real(*args)

        binary = real.binary

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", Spy())
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    b = torch.randn(8)
    torch.testing.assert_close(linear_mod.linear(x, w, b), F.linear(x, w, b), rtol=1e-5,
                               atol=1e-5)
    gate, up = F.linear(x, w, b).split(4, dim=-1)
    torch.testing.assert_close(linear_mod.silu_and_mul(x, w, b, 4), F.silu(gate) * up,
                               rtol=1e-5, atol=1e-5)
    assert bool(onednn_calls) == (picked == "onednn")


@pytest.mark.parametrize("text", [None, "", "{not json", "[1, 2]", '{"linear": 3}'])
def test_a_missing_or_bad_calibration_falls_back_and_is_measured_again(text, tmp_path,
                                                                       monkeypatch) -> None:
    """No record, or one that does not parse or names no known library: the engine uses the
    default (oneDNN), and setup's step measures again rather than failing."""
    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gemm, "_onednn_available", lambda: True)
    if text is not None:
        gemm.choice_path().parent.mkdir(parents=True)
        gemm.choice_path().write_text(text)
    measured = {"linear": "torch", "swiglu": "torch", "seconds": {}}
    monkeypatch.setattr(gemm, "calibrate", lambda: measured)
    gemm.choice.cache_clear()
    try:
        assert gemm.choice() == gemm.DEFAULT
        assert gemm.calibrate_if_needed() is measured
    finally:
        gemm.choice.cache_clear()


def test_the_recorded_choice_is_read_by_a_new_process(tmp_path) -> None:
    """What setup recorded is what a later engine process uses."""
    env = {**os.environ, "PDCLUSTER_CACHE_DIR": str(tmp_path)}
    code = ("import json, sys\nfrom pdcluster.engine.kernels import gemm\n"
            "if sys.argv[1] == 'write':\n"
            "    gemm.choice_path().parent.mkdir(parents=True)\n"
            "    picked = {'linear': 'torch', 'swiglu': 'onednn'}\n"
            "    gemm.choice_path().write_text(json.dumps(picked))\n"
            "print(json.dumps(gemm.choice()))\n")
    for step in ("write", "read"):
        proc = subprocess.run([sys.executable, "-c", code, step], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip() == '{"linear": "torch", "swiglu": "onednn"}'

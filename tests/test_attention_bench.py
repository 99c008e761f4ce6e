"""The decode-attention harness (benchmarks/attention_bench.py), on CPU through Triton's
interpreter: one small case of the engine's kernel on the engine's cache views, against gather
+ SDPA (float32: the same numbers up to summation order), libraries not installed said so; and
its refusal to time anything without a GPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks import __main__ as harnesses
from benchmarks import attention_bench
from tests.triton_kernels import kernel_device, triton_ops


def test_a_case_runs_the_kernel_on_the_engines_views_and_agrees_with_sdpa():
    triton_ops()  # the kernels, interpreted where there is no GPU
    case = attention_bench.Case("tiny", batch=3, context=37, num_heads=4, num_kv_heads=2,
                                head_dim=16, dtype=torch.float32)
    x = attention_bench.Inputs.make(case, kernel_device())
    assert not x.k_cache.is_contiguous()  # strided, as PagedKVCache.layer_kv gives them
    assert x.table.shape == (3, 3) and sorted(x.table.flatten().tolist()) == list(range(9))
    fields = attention_bench.measure(case, kernel_device(), repeats=1, copy_gb_s=10.0)
    assert fields["ours_us"] > 0 and fields["gather_sdpa_us"] > 0
    assert fields["gather_sdpa_max_diff"] < 1e-5, fields
    assert fields["floor_us"] == round(case.kv_bytes / 10e9 * 1e6, 1)
    assert case.kv_bytes == 2 * 3 * 37 * 2 * 16 * 4
    for library in ("flashinfer", "flash_attn"):
        assert fields.get(library, "") == "not installed" or f"{library}_us" in fields


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without one")
def test_without_a_gpu_it_refuses_by_name(capsys):
    assert harnesses.main(["attention", "--quick"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err

"""The engine's Triton kernels, as it launches them on real models' shapes, build for Hopper
(sm_90) and fit its multiprocessors: shared memory within a block's 227 KB, no register spilled
to local memory. Built here without a GPU (tests/sm90_build.py says how), so that a launch
which could only fail on the GPU machine fails in `make test` instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sm90_build import SM90_SHARED_PER_BLOCK

REPO = Path(__file__).resolve().parents[2]
SHARDS = 2  # one process a core: the builds are ptxas's time, serial in one process


@pytest.fixture(scope="module")
def sm90(tmp_path_factory) -> dict:
    """The builds of tests/sm90_build.py, in processes of their own (Triton's interpreter,
    which this process imported for the other kernel tests, cannot build)."""
    cache = tmp_path_factory.mktemp("triton-cache")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.sm90_build", "--json",
                               "--shard", f"{shard}/{SHARDS}"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for shard in range(SHARDS)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"tests.sm90_build failed:\n{out[-3000:]}\n{err[-3000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    return {"kernels": results[0]["kernels"],
            "builds": [build for result in results for build in result["builds"]]}


def _where(build: dict) -> str:
    return (f"{build['kernel']} on {build['model']} in {build['dtype']} "
            f"({build['constants']}, {build['num_warps']} warps, {build['num_stages']} stages)")


def test_every_kernel_the_engine_launches_is_built(sm90):
    built = {build["kernel"] for build in sm90["builds"]}
    assert len(sm90["kernels"]) >= 10
    assert built == set(sm90["kernels"]), "a kernel no launch in tests/sm90_build.py reaches"
    assert {b["dtype"] for b in sm90["builds"]} == {"bfloat16", "float32"}


def test_every_build_fits_a_hopper_block_in_shared_memory(sm90):
    over = [f"{_where(b)}: {b['shared']} B" for b in sm90["builds"]
            if b["shared"] > SM90_SHARED_PER_BLOCK]
    assert not over, f"more shared memory than a block gets ({SM90_SHARED_PER_BLOCK} B): {over}"


def test_no_build_spills_registers(sm90):
    spills = [f"{_where(b)}: {b['spill_stores']} B spilled, {b['registers']} registers"
              for b in sm90["builds"] if b["spill_stores"] or b["spill_loads"]]
    assert not spills, spills

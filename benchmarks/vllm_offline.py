"""vLLM's offline `LLM` timing one batch, for `bench vllm` (a script: vLLM's engine core
re-imports the main module). `python vllm_offline.py JOB.json OUT.json`: JOB holds model,
prompts (token ids), output_len and block_size; OUT gets {"seconds": wall time of the batch
after a warm-up request}. Settings as the nodes run vLLM (vllm_backend/settings.py)."""

from __future__ import annotations

import json
import sys
import time


def main(job_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(job_path) as f:
        job = json.load(f)
    llm = LLM(model=job["model"], dtype="float32", block_size=job["block_size"],
              enforce_eager=True, kv_cache_memory_bytes=1 << 30, max_model_len=4096,
              prefix_caching_hash_algo="sha256_cbor", seed=0)
    params = SamplingParams(max_tokens=job["output_len"], temperature=0.0, ignore_eos=True,
                            detokenize=False)
    llm.generate([{"prompt_token_ids": job["prompts"][0][:16]}], params, use_tqdm=False)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params,
                           use_tqdm=False)
    seconds = time.perf_counter() - started
    assert all(len(o.outputs[0].token_ids) == job["output_len"] for o in outputs)
    with open(out_path, "w") as f:
        json.dump({"seconds": seconds}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""vLLM's own offline `LLM` on token-id prompts, greedy: the reference a vLLM-backed cluster must
equal token for token. Run as a script (vLLM's engine core starts by `spawn` and re-imports the
main module): `python offline_reference.py MODEL IN.json OUT.json`, IN holding
{"prompts": [[ids]...], "max_tokens": N, "block_size": B}; OUT gets {"tokens": [[ids]...]}."""

from __future__ import annotations

import json
import sys


def main(model: str, inp: str, out: str) -> None:
    from vllm import LLM, SamplingParams

    with open(inp) as f:
        job = json.load(f)
    # As the nodes run it (pdcluster/vllm_backend/settings.py): float32 on CPU, eager,
    # the same block size and prefix-cache hash.
    llm = LLM(model=model, dtype="float32", block_size=job["block_size"], enforce_eager=True,
              kv_cache_memory_bytes=1 << 28, max_model_len=2048,
              prefix_caching_hash_algo="sha256_cbor", seed=0)
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0,
                            ignore_eos=job.get("ignore_eos", False), detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params,
                           use_tqdm=False)
    with open(out, "w") as f:
        json.dump({"tokens": [list(o.outputs[0].token_ids) for o in outputs]}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])

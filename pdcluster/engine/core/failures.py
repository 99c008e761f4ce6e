"""`EngineFailure`: the engine as a whole is lost (torch-free, so every layer can raise it),
and its kind `TensorParallelError`.

Raised by `LLMEngine.step` when no later step can succeed either — e.g.
engine.runner.tp_workers.TensorParallelError, a tensor-parallel rank that died or stalls. A
node that gets it fails its requests and exits so that it is restarted (node/server.py); any
other exception from a step fails that step's requests only. Re-exported by engine/api.py.
"""

from __future__ import annotations


class EngineFailure(RuntimeError):
    """The engine can no longer serve: the node must be restarted."""


class TensorParallelError(EngineFailure):
    """A tensor-parallel rank died, stalled or failed (engine/runner/tp_workers.py): the
    engine cannot go on."""

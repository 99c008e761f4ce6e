"""`VllmEngineLost`: vLLM's engine is dead for good, as the node must hear it.

vLLM ends its engine when any of its processes dies or fails: a tensor-parallel worker killed
(the OOM killer, a crash) makes its executor shut down every rank and its engine core report
itself dead; the node's `AsyncLLM` then fails every request's stream with `EngineDeadError`
and answers nothing again. Taken one request at a time (a request that "failed") the node
would go on serving: registered, admitting requests it can only fail, holding the KV it had
pinned for a decode node that will never be sent it. `raise_if_dead` turns vLLM's dead state
into `engine.api.EngineFailure` instead, which the node server meets like the own engine's
dead rank (node/server.py: every request fails with "internal", the node stops serving and
reports `on_fatal`, where a node actor exits so that Ray restarts it). `is_dead` lets an idle
node notice too: a dead engine counts as having work (the step that reports its death).

API: `VllmEngineLost`, `is_dead`, `raise_if_dead`.
"""

from __future__ import annotations

from typing import Any

from pdcluster.engine.api import EngineFailure


class VllmEngineLost(EngineFailure):
    """vLLM's engine core or one of its worker processes died or failed."""


def is_dead(llm: Any) -> bool:
    """Whether `llm` (vLLM's `AsyncLLM`; None once the node closed it) is dead: its engine
    core reported itself dead or went away, or its output handler failed."""
    return llm is not None and bool(llm.errored)


def raise_if_dead(llm: Any, tensor_parallel_size: int) -> None:
    """`VllmEngineLost` if `llm` is dead."""
    if not is_dead(llm):
        return
    workers = (f"one of its {tensor_parallel_size} tensor-parallel worker processes"
               if tensor_parallel_size > 1 else "its worker process")
    raise VllmEngineLost(f"vLLM's engine is dead: its engine core or {workers} died or "
                         "failed (vLLM's log names which)")

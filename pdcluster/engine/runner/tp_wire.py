"""What rank 0 sends the other tensor-parallel ranks on their step pipes
(engine/runner/tp_workers.py), as msgpack-ready dicts: a step's plan (arrays as raw bytes with
their dtype and shape, never pickle) and a step's host-tier copies (slot pairs).

API: `encode_plan`, `decode_plan`, `encode_copies`, `decode_copies`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pdcluster.engine.core.kv_tiers import TierCopies
from pdcluster.engine.runner.inputs import StepInputs, StepPlan

_COPY_KINDS = tuple(f.name for f in dataclasses.fields(TierCopies))


def encode_plan(plan: StepPlan) -> dict:
    inputs = plan.inputs
    return {"ids": _pack(inputs.token_ids), "positions": _pack(inputs.positions),
            "slots": _pack(inputs.slot_rows), "last": inputs.last_rows,
            "decodes": inputs.num_decodes, "lens": _pack(inputs.decode_lens),
            "chunks": [list(chunk) for chunk in inputs.chunks],
            "table": None if plan.decode_table is None else _pack(plan.decode_table),
            "rows": _pack(plan.logit_rows), "replay": plan.replay}


def decode_plan(message: dict) -> StepPlan:
    inputs = StepInputs(_unpack(message["ids"]), _unpack(message["positions"]),
                        _unpack(message["slots"]), list(message["last"]), message["decodes"],
                        _unpack(message["lens"]),
                        [(row, pos, list(blocks)) for row, pos, blocks in message["chunks"]])
    table = None if message["table"] is None else _unpack(message["table"])
    return StepPlan(inputs, table, _unpack(message["rows"]), message["replay"])


def _pack(array: np.ndarray) -> list:
    return [array.dtype.str, list(array.shape), array.tobytes()]


def _unpack(packed: list) -> np.ndarray:
    dtype, shape, data = packed
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()


def encode_copies(copies: TierCopies) -> dict:
    return {kind: [list(pair) for pair in getattr(copies, kind)] for kind in _COPY_KINDS}


def decode_copies(message: dict) -> TierCopies:
    return TierCopies(**{kind: [(a, b) for a, b in message[kind]] for kind in _COPY_KINDS})

"""The decode node's Ray actor: admits requests whose prompt KV arrives from a prefill node
(or prefills short remainders itself), reuses its own prefix cache across conversation
turns, and streams tokens. All behaviour lives in `node.NodeActor`; the launcher applies
`ray.remote`."""

from __future__ import annotations

from node.actor import NodeActor


class DecodeNodeActor(NodeActor):
    role = "decode"

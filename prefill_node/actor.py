"""The prefill node's Ray actor: runs prompts, writes the KV blocks decode nodes lack into
them through the KV connector, returns the first token, and keeps the blocks in its own prefix
cache. All behaviour lives in `node.NodeActor`; the launcher applies `ray.remote`."""

from __future__ import annotations

from node.actor import NodeActor


class PrefillNodeActor(NodeActor):
    role = "prefill"

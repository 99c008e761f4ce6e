"""The node runtime shared by prefill and decode nodes: an `LLMEngine` with the KV connector,
served by `node.server.NodeServer`, registered with the metadata service under a lease
and publishing its KV block events. Ray-free: `prefill_node/` and `decode_node/` are the thin
Ray actors around it (see docs/architecture.md for why this room exists)."""

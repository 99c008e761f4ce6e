"""Decode node room: the Ray entry point for a node in the decode role — one actor class,
`DecodeNodeActor`, that the launcher wraps with `ray.remote`. It holds no logic of its own:
the node (engine, KV connector, node server, metadata registration) is `node/`, and a node's
role in a request is that request's `TransferSpec`, not a mode of this package.
"""

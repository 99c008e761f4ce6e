"""Metadata service room: the gRPC server holding the node registry (with leases), the global
block index `block_hash -> nodes`, prefix queries and the event stream, over etcd or in-memory
(embedded default) storage. Never imports torch, ray or `engine`: it runs in small CPU-only pods.
Filled by a later issue.
"""

"""Decode node room: a thin Ray actor and node server running the engine in the decode role,
receiving KV blocks from prefill nodes and streaming tokens back to the router.
Filled by a later issue.
"""

"""Prefill node room: a thin Ray actor and node server running the engine in the prefill role,
turning prompts into KV cache and writing the blocks into decode nodes through `transfer`.
Filled by a later issue.
"""

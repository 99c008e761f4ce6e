"""Router room: the OpenAI-compatible HTTP API, tokenizer and chat templates, the routing policy
(a pure cost function of prefix overlap vs. load), node discovery and metrics. Never imports
torch, ray or `engine`: it runs in small CPU-only pods.
The HTTP app is `router.server`; see docs/router.md for the modules.
"""

"""Router room, in three sub-rooms by job:

- `api/`: the OpenAI-compatible HTTP edge (aiohttp app, handlers, protocol, tokenizer);
- `routing/`: where a request goes (the pure cost function, node views, links to the nodes and
  the metadata service, dispatch, migration);
- `sim/`: offline replay and synthetic traces, never imported by the serving path.

`config`, `errors` and `metrics` are shared by the first two. Never imports torch, ray or
`engine`: the router runs in small CPU-only pods. See docs/router.md for the modules.
"""

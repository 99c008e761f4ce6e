"""Offline simulation, never imported by the serving path: `pdcluster replay` runs a request trace
through `router.routing.policy` over simulated nodes (`sim_nodes`), and `trace_gen` generates
synthetic traces with real services' prefix structure."""

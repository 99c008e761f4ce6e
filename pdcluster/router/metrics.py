"""Prometheus metrics of the router, on a registry of its own (several routers can live in one
test process). API: `RouterMetrics`."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdcluster.router.routing.identity import Quarantine

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                    60)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("router_requests", "HTTP API requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("router_ttft_seconds", "time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("router_inter_token_latency_seconds",
                             "time between streamed token deltas", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("router_e2e_latency_seconds", "request start to last token",
                             registry=r, buckets=_LATENCY_BUCKETS)
        self.prompt_tokens = Counter("router_prompt_tokens", "prompt tokens routed", registry=r)
        self.prefix_hit_tokens = Counter("router_prefix_hit_tokens",
                                         "prompt tokens the chosen node already held",
                                         registry=r)
        self.node_prompt_tokens = Counter(
            "router_node_prompt_tokens", "prompt tokens of every node request (each sample "
            "of n / best_of counts)", registry=r)
        self.node_cached_tokens = Counter(
            "router_node_cached_tokens", "of those, the tokens the serving node reported "
            "found in its prefix cache (samples after the first of n should find the prompt)",
            registry=r)
        self.decisions = Counter("router_routing_decisions",
                                 "placements by node, role and reason",
                                 ["node", "role", "reason"], registry=r)
        self.metadata_latency = Histogram("router_metadata_query_seconds",
                                          "metadata prefix-query latency", registry=r,
                                          buckets=_LATENCY_BUCKETS)
        self.metadata_available = Gauge("router_metadata_available",
                                        "1 if prefix-aware routing is on, 0 if load-only",
                                        registry=r)
        self.mirror_in_sync = Gauge("router_index_mirror_in_sync", "1 while the router's copy "
                                    "of the block index follows the metadata service (prefix "
                                    "hits answered in memory), 0 while it asks per request",
                                    registry=r)
        self.mirror_blocks = Gauge("router_index_mirror_blocks", "distinct block hashes in "
                                   "the router's copy of the index", registry=r)
        self.healthy_nodes = Gauge("router_healthy_nodes", "nodes answering load queries",
                                   registry=r)
        self.recent_work = Gauge("router_node_recent_work", "decayed work the router sent "
                                 "each node, in prefill-token equivalents (the policy's "
                                 "recent_work)", ["node"], registry=r)
        self.prefix_pulls = Counter("router_prefix_pulls", "requests whose prefilling node was "
                                    "told to pull its prefix from another node", registry=r)
        self.unattested_claims = Counter(
            "router_unattested_claims", "blocks a node claimed (index events) whose tokens "
            "this router never gave it: ignored for routing", ["node"], registry=r)
        self.aborts = Counter("router_aborts", "requests aborted on the nodes (disconnects, "
                              "stop strings)", registry=r)
        self.migrations = Counter("router_migrations", "requests moved to another node after "
                                  "their decode node was lost mid-stream", registry=r)
        self.prefill_lost = Counter("router_prefill_lost", "disaggregated requests whose "
                                    "prefill node died (lost) or refused them (refused) "
                                    "before their KV arrived: the decode node was told to "
                                    "compute the prompt itself", ["why"], registry=r)
        self.quarantined_nodes = Gauge(
            "router_quarantined_nodes", "registered nodes whose KV identity (block size, hash "
            "algorithm and seed, model, tokenizer) differs from the cluster's: sent nothing",
            registry=r)
        self.node_quarantined = Gauge(
            "router_node_quarantined", "1 for each quarantined node, with the identity fields "
            "that differ (comma-separated)", ["node", "mismatch"], registry=r)
        self.migration_failures = Counter(
            "router_migration_failures", "requests whose decode node was lost and that could "
            "not move (no migration left, no healthy node)", ["reason"], registry=r)
        self.output_tokens = Counter("router_output_tokens", "tokens streamed to clients (the "
                                     "planner's output length per request)", registry=r)
        self.shed = Counter("router_shed_requests", "requests refused with 429 by admission "
                            "(predicted TTFT over their class's limit), by priority class",
                            ["priority"], registry=r)
        self.tenant_limited = Counter(
            "router_tenant_limited_requests", "requests refused with 429 because their tenant "
            "had its limit of requests or tokens in flight (router.planning.tenant_limits)",
            registry=r)
        self.admission_probes = Counter(
            "router_admission_probes", "requests admitted over their predicted TTFT because "
            "their node had none for probe_after_s (re-calibrating its prediction)",
            registry=r)
        self.admission_waiting = Gauge("router_admission_waiting", "requests held by "
                                       "admission (mode queue) until their predicted TTFT "
                                       "fits", registry=r)
        self.ttft_prediction_error = Histogram(
            "router_ttft_prediction_error_seconds", "|measured - predicted| TTFT of admitted "
            "requests (the admission predictor's error)", registry=r,
            buckets=_LATENCY_BUCKETS)
        self.ttft_prediction_relative_error = Gauge(
            "router_ttft_prediction_relative_error", "recent mean of |measured - predicted| "
            "/ measured TTFT", registry=r)

    def show_quarantine(self, quarantined: Mapping[str, Quarantine]) -> None:
        """The quarantined nodes now (router.routing.identity), replacing the last ones."""
        self.quarantined_nodes.set(len(quarantined))
        self.node_quarantined.clear()
        for node_id, verdict in quarantined.items():
            self.node_quarantined.labels(node_id, ",".join(verdict.fields)).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)

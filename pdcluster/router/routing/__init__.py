"""The routing decision and what feeds it: the pure cost function (`policy`, with the cache-blind
`baselines`), the node views and load decay, the links to nodes and to the metadata service,
`dispatch` (deciding kept apart from sending) and `migration`. No HTTP framework here."""

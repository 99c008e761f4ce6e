"""Planning: how many prefill and decode nodes the cluster should run (the planner's pure
decision and its capacity model) and whether the router admits a request (predicted TTFT)."""

"""KV storage: the paged device cache and its byte layout, the host and disk tiers."""

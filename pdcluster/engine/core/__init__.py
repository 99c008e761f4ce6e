"""The engine's torch-free core: requests and their queues, the scheduler, the block pool
and prefix cache, the KV cache manager and its tiers' bookkeeping, pins, validation."""

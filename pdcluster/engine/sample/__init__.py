"""Sampling: logits processors, grammar masks, the sampler, and speculative decoding's
verification of proposed tokens (rejection sampling)."""

"""Benchmarks room: reproducible benchmarks, each measuring its own baseline in the same run and
printing one JSON object as its last line of output.
"""

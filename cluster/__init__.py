"""Cluster room: launching the whole system. Owns the `pdcluster` CLI (`cluster.cli`), and in
later issues the local all-in-one mode and the entrypoint for `ray job submit`. Must not import
torch or `engine` at module level: `pdcluster --help` stays fast and torch-free.
"""

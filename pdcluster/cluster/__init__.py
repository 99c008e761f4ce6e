"""Cluster room: launching the whole system. Owns the `pdcluster` CLI (`cluster.cli`), the
node actors on Ray (`cluster.ray_cluster`), and the all-in-one `pdcluster serve` that is also
the entrypoint for `ray job submit` (`cluster.launch`). Must not import
torch or `engine` at module level: `pdcluster --help` stays fast and torch-free.
"""

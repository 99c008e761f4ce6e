"""Harnesses and studies that run from a checkout and are not part of the installed package
(pyproject.toml packages `pdcluster*` only): the chaos harness (faults under load; it runs
`unshare` and `iptables` for its link faults), the peer comparison (installs vLLM and others
into their own venvs), vLLM as the nodes' engine against vLLM offline, and one-off studies
(grammar libraries, MLA decode, a MoE step). Run one as `python -m benchmarks NAME [--json]`
from the repository root (`python -m benchmarks --help` lists them; the Makefile has targets).
What users get, `pdcluster bench`, is pdcluster/benchmarks.
"""

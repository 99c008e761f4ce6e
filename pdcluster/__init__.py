"""pdcluster: a disaggregated prefill/decode LLM serving cluster.

Every room is a subpackage: `pdcluster.core`, `pdcluster.engine`, `pdcluster.router`, … (the
folders under pdcluster/; docs/architecture.md says who may import whom).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pdcluster")
except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
    __version__ = "0+unknown"

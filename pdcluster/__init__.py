"""pdcluster: a disaggregated prefill/decode LLM serving cluster.

Installed, every room is a subpackage of this one (`pdcluster.core`, `pdcluster.engine`, …), so
nothing of ours lands at the top level of site-packages. In the repository the rooms stay at the
top level (`core/`, `engine/`, …) and this folder holds one symlink per room, so a checkout on
`PYTHONPATH` imports exactly as an installed wheel does. The wheel itself is built by the
`package-dir` mapping in pyproject.toml, not by following these links.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pdcluster")
except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
    __version__ = "0+unknown"

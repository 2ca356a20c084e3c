"""gcache: a distributed, tiered KV-cache store for LLM inference.

``gcache.__version__`` is the installed distribution's version (``--version`` on every
command prints it).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gcache")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]

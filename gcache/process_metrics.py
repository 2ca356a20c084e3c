"""What every gcache process exports next to its own metrics: ``process_*`` (CPU,
resident memory, open fds, start time), ``python_info``, and
``gcache_build_info{version, component}``; and no ``*_created`` series.

Used by the server's and the master's metrics registries (``add_process_metrics``).
Importing this module turns the ``*_created`` series off process-wide (they double the
series count and no dashboard reads them); it is idempotent.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Info, PlatformCollector, ProcessCollector

from gcache import __version__

prometheus_client.disable_created_metrics()


def add_process_metrics(registry: CollectorRegistry, component: str) -> None:
    """Register the process, platform and build-info collectors in ``registry``;
    ``component``: "server" or "master"."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    Info("gcache_build", "The gcache build this process runs",
         registry=registry).info({"version": __version__, "component": component})

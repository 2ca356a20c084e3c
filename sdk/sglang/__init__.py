"""SGLang HiCache L3 storage backend on gcache (SWA-aware, zero-copy).

SGLang loads the plugin by module path: ``"module_path": "gcache.sdk.sglang",
"class_name": "GCacheStorage"`` (docs/sglang.md). The package:

* ``backend.py``: ``GCacheStorage``, the ``HiCacheStorage`` subclass, and its contract
  (which SGLang thread calls each method, and how long it may block). It imports SGLang,
  so this package builds it on first access of ``GCacheStorage``;
* ``host_pools.py``: a registered host pool's ``PoolSpec`` (object identity) and its
  pointer -> host-memory view mapping;
* ``chain_store.py``: the engine-independent core, ``ChainStore`` (pages of prefix
  chains as gcache objects: placement groups, skip-existing, keep-alive) and the pure
  rules ``chain_groups`` and ``window_safe_stops`` (the SWA window-safe hit), which
  ``gcache.bench.swa_replay`` also runs;
* ``config.py``: ``PluginConfig``, read and checked from SGLang's ``extra_config``.

Everything but ``GCacheStorage`` imports without SGLang.
"""

from __future__ import annotations

from typing import Any

from gcache.sdk.sglang.chain_store import (
    ChainStore,
    HitPolicy,
    PoolSpec,
    SidePool,
    Stats,
    WindowSafeHit,
    chain_groups,
    leading,
    window_safe_stops,
)
from gcache.sdk.sglang.config import PluginConfig

__all__ = [
    "ChainStore",
    "GCacheStorage",  # noqa: F822 - imported on first access by __getattr__
    "HitPolicy",
    "PluginConfig",
    "PoolSpec",
    "SidePool",
    "Stats",
    "WindowSafeHit",
    "chain_groups",
    "leading",
    "window_safe_stops",
]


def __getattr__(name: str) -> Any:
    if name == "GCacheStorage":  # needs SGLang: imported here, not with the package
        from gcache.sdk.sglang.backend import GCacheStorage

        globals()[name] = GCacheStorage
        return GCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

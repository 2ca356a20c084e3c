"""vLLM v1 KV connector on gcache (hybrid-aware: full, MLA and sliding-window groups).

vLLM loads it by module path (docs/vllm.md)::

    --kv-transfer-config '{"kv_connector": "GCacheConnectorV1",
                           "kv_connector_module_path": "gcache.sdk.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"masters": "host:port"}}'

The package:

* ``connector.py``: ``GCacheConnectorV1`` (``KVConnectorBase_V1`` + ``SupportsHMA``) and
  its contract: which vLLM side calls each method, and what a store fault becomes. It
  imports vLLM, so this package builds it on first access;
* ``matching.py``: the hit rule (full groups: every block; sliding-window groups: the
  window), pure and vLLM-free;
* ``layout.py``: a group's block -> byte runs of the KV tensors (in place when a block
  is one run);
* ``config.py``: ``ConnectorConfig``, read and checked from ``kv_connector_extra_config``.
"""

from __future__ import annotations

from typing import Any

from gcache.sdk.vllm.config import ConnectorConfig
from gcache.sdk.vllm.matching import GroupKind, GroupPlan, longest_hit, plan_lookup

__all__ = ["ConnectorConfig", "GCacheConnectorV1", "GroupKind",  # noqa: F822
           "GroupPlan", "longest_hit", "plan_lookup"]


def __getattr__(name: str) -> Any:
    if name == "GCacheConnectorV1":  # needs vLLM: imported here, not with the package
        from gcache.sdk.vllm.connector import GCacheConnectorV1

        globals()[name] = GCacheConnectorV1
        return GCacheConnectorV1
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

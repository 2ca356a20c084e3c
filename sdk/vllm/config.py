"""The vLLM connector's settings: ``kv_connector_extra_config``, checked at start-up.

Every key, its type and default is in ``KEYS``; an unknown key or a bad value raises
``ConfigError`` naming the key (a setup fault), with a "did you mean" for typos. The
client also reads ``GCACHE_*`` environment variables and ``config_file`` as the SDK does.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any, Mapping

from gcache.config import parse_bool, parse_size
from gcache.errors import ConfigError


@dataclass(frozen=True)
class ConnectorConfig:
    """What ``GCacheConnectorV1`` reads from ``kv_connector_extra_config``."""

    masters: str = ""  # gcache-master API addresses, "host:port,host:port"
    servers: str = ""  # or gcache-server addresses (no masters: a static ring)
    namespace: str = "vllm"  # prefix: the namespace is <namespace>/<model>-<fingerprint>
    credential: str | None = None  # "id:secret" (or env GCACHE_CREDENTIAL)
    token: str | None = None  # the legacy shared secret
    transport: str | None = None  # auto | tcp | shm | nixl (SDK default: auto)
    config_file: str | None = None  # a TOML file with [client] keys
    timeout_ms: int | None = None  # the client's default deadline
    lookup_timeout_ms: int = 200  # the scheduler's exists: past it, a miss
    load_timeout_ms: int = 5000  # a request's load: past it, its blocks are load errors
    save_timeout_ms: int = 10000  # a finished request's save: past it, not saved
    save: bool = True  # False: read-only (another engine writes)
    staging_keep_bytes: int = 1 << 30  # host staging kept for reuse (layouts not in place)
    # the KV-cache layout asked of vLLM: BLHNC (block outermost) makes each block one run
    # the SDK moves in place; "none" asks nothing (vLLM warns and picks another when a
    # backend cannot take it: the connector then stages through host buffers)
    kv_layout: str = "BLHNC"
    tp_rank: int | None = None  # tests only: the TP rank when vLLM's is not set up

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> "ConnectorConfig":
        known = {f.name: f for f in fields(cls)}
        kw: dict[str, Any] = {}
        for k, v in extra.items():
            if k not in known:
                hint = difflib.get_close_matches(k, list(known), n=1)
                raise ConfigError(
                    f"kv_connector_extra_config: unknown key {k!r}"
                    + (f" (did you mean {hint[0]!r}?)" if hint else "")
                    + f"; the gcache connector takes {', '.join(sorted(known))}")
            kw[k] = _value(k, v, known[k].default)
        cfg = cls(**kw)
        if not cfg.masters and not cfg.servers:
            raise ConfigError("kv_connector_extra_config needs 'masters' (gcache-master "
                              "API addresses) or 'servers' (gcache-server addresses)")
        for k in ("lookup_timeout_ms", "load_timeout_ms", "save_timeout_ms"):
            if getattr(cfg, k) <= 0:
                raise ConfigError(f"kv_connector_extra_config: {k} must be > 0")
        return cfg


def _value(key: str, v: Any, default: Any) -> Any:
    if key in ("masters", "servers") and isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    try:  # the project's parsers: "1GiB", "yes"/"off", with their own messages
        if key == "save":
            return parse_bool(v)
        if key.endswith("_bytes"):
            return parse_size(v)
    except ConfigError as exc:
        raise ConfigError(f"kv_connector_extra_config: {key}: {exc}") from None
    if key.endswith("_ms") or key == "tp_rank":
        try:
            return int(v)
        except (TypeError, ValueError):
            raise ConfigError(f"kv_connector_extra_config: {key} must be an integer, "
                              f"not {v!r}") from None
    if v is not None and not isinstance(v, str):
        raise ConfigError(f"kv_connector_extra_config: {key} must be a string, not {v!r}")
    return v if v is not None else default

"""The plugin's own config: ``PluginConfig``, read from SGLang's storage ``extra_config``.

Bad config is a setup fault: ``PluginConfig.from_extra`` raises ``ConfigError`` naming
the key and what to change, so the engine's attach fails with that message. Every key
is listed in docs/sglang.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from gcache.credentials import parse_client_credential
from gcache.errors import ConfigError

#: extra_config keys that belong to SGLang and are passed through to us.
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "file_storage_path",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size",
})


@dataclass(frozen=True, slots=True)
class PluginConfig:
    """The backend's own knobs, read from SGLang's storage extra_config."""

    masters: tuple[str, ...] = ()
    servers: tuple[str, ...] = ()
    namespace: str = "sglang"
    timeout_ms: int = 1000
    token: str | None = None
    credential: str | None = None  # "id:secret"; scopes the instance to its namespaces
    group_policy: str = "chain"
    group_pages: int = 64
    skip_existing: bool = True
    touch: bool = True
    touch_interval_ms: int = 30_000
    config_file: str | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> PluginConfig:
        """Parse and check ``extra_config``. Raises ConfigError naming the bad key."""
        extra = dict(extra or {})
        fields = cls.__dataclass_fields__
        ours = set(fields)
        unknown = sorted(k for k in extra if k not in ours and k not in SGLANG_KEYS)
        if unknown:
            raise ConfigError(f"unknown gcache extra_config keys {unknown}; valid keys: "
                              f"{sorted(ours)} (see docs/sglang.md)")

        def addrs(name: str) -> tuple[str, ...]:
            v = extra.get(name) or ()
            if isinstance(v, str):
                v = [a for a in v.split(",") if a.strip()]
            if not isinstance(v, (list, tuple)) or not all(isinstance(a, str) for a in v):
                raise ConfigError(f"extra_config {name!r} must be a list of 'host:port' strings")
            for a in v:
                host, _, port = a.strip().rpartition(":")
                if not host or not port.isdigit():
                    raise ConfigError(f"extra_config {name!r}: {a!r} is not host:port")
            return tuple(a.strip() for a in v)

        def integer(name: str, lo: int) -> int:
            v = extra.get(name, fields[name].default)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"extra_config {name!r} must be an int >= {lo}, got {v!r}")
            return v

        def boolean(name: str) -> bool:
            v = extra.get(name, fields[name].default)
            if not isinstance(v, bool):
                raise ConfigError(f"extra_config {name!r} must be true or false, got {v!r}")
            return v

        def text(name: str, default: str | None) -> str | None:
            v = extra.get(name, default)
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"extra_config {name!r} must be a string, got {v!r}")
            return v

        def credential() -> str | None:
            v = text("credential", None)
            if v:
                parse_client_credential(v)  # ConfigError, never echoing the secret
            return v

        masters, servers = addrs("masters"), addrs("servers")
        if not masters and not servers:
            raise ConfigError('gcache needs "masters": ["host:port", ...] or "servers": '
                              '[...] in --hicache-storage-backend-extra-config')
        policy = text("group_policy", fields["group_policy"].default)
        if policy not in ("chain", "key"):
            raise ConfigError(f'extra_config "group_policy" must be "chain" or "key", got {policy!r}')
        return cls(masters=masters, servers=servers,
                   namespace=text("namespace", "sglang") or "sglang",
                   timeout_ms=integer("timeout_ms", 1), token=text("token", None),
                   credential=credential(),
                   group_policy=policy, group_pages=integer("group_pages", 1),
                   skip_existing=boolean("skip_existing"), touch=boolean("touch"),
                   touch_interval_ms=integer("touch_interval_ms", 0),
                   config_file=text("config_file", None))

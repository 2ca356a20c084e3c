"""Address helpers shared by every daemon: parsing and the loopback-without-token rule."""

from __future__ import annotations

import ipaddress


def split_hostport(addr: str) -> tuple[str, int]:
    host, port = addr.rsplit(":", 1)
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(listen: str, token: str) -> None:
    """Refuse a non-loopback listen address without a token (ValueError)."""
    host = split_hostport(listen)[0]
    if not token and not is_loopback(host):
        raise ValueError(f"refusing to bind non-loopback address {host} without a token: "
                         "set --token (or GCACHE_TOKEN) on every server and client")

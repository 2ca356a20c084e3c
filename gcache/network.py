"""Host and address helpers shared by every daemon and the SDK: parsing, the
loopback-without-token rule, and this host's boot id."""

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


def check_bind(listen: str, token: str, flag: str = "--listen") -> None:
    """Refuse a non-loopback listen address without a token (ValueError); ``flag`` names
    the option that asked for it."""
    host = split_hostport(listen)[0]
    if not token and not is_loopback(host):
        raise ValueError(f"refusing to bind non-loopback address {host} ({flag}) without a "
                         "token: set --token (or GCACHE_TOKEN) on every server and client, "
                         "or bind loopback")


def boot_id() -> str:
    """This kernel boot's id ('' when unknown): two processes see the same value only
    when they run on the same host since the same boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""

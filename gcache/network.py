"""Host and address helpers shared by every daemon and the SDK: parsing, the
loopback-without-token rule, this host's boot id, and the lingering close."""

from __future__ import annotations

import ipaddress
import socket
import time


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


def check_bind(listen: str, token: str | bool, flag: str = "--listen") -> None:
    """Refuse a non-loopback listen address without auth (ValueError). ``token`` is the
    token, or True when auth is on some other way (a credentials file); ``flag`` names the
    option that asked for the bind."""
    host = split_hostport(listen)[0]
    if not token and not is_loopback(host):
        raise ValueError(f"refusing to bind non-loopback address {host} ({flag}) without "
                         "auth: set --credentials-file (or --token) on the server, and give "
                         "every client a credential, or bind loopback")


def boot_id() -> str:
    """This kernel boot's id ('' when unknown): two processes see the same value only
    when they run on the same host since the same boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def linger(sock: socket.socket, linger_s: float = 1.0) -> None:
    """The first half of a lingering close, after a last error reply: closing with unread
    input makes the kernel send RST, which destroys the reply before the peer reads it
    (or fails a peer still sending its payload). Send FIN, then drain what the peer
    still sends for at most ``linger_s``. The caller closes. Never raises OSError."""
    try:
        sock.shutdown(socket.SHUT_WR)  # an SSLSocket drops its TLS layer here
        end, sink = time.monotonic() + linger_s, bytearray(16 << 10)
        while (left := end - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv_into(sink):
                break
    except (OSError, ValueError):
        pass

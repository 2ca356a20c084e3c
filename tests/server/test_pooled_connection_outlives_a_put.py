"""A connection that sent a PUT stays open while idle, plain or TLS.

The server reads a PUT's payload within the request's deadline (the watchdog's, and on
a plain socket a native read that stops a little after it). Nothing of that deadline
may outlive the request: an authenticated connection may idle as long as it likes
between requests (a client's pooled connection). Here a raw client puts a value of
several TLS records over a server whose request deadline is 1 s, idles for 3.5 s (past
the deadline and its backstop), then pings and reads the value back on the same
connection. A socket timeout armed with the payload read's stop (the TLS read path
arms the socket) would have ended the idle wait and closed the connection.
"""

from __future__ import annotations

import os
import socket
import ssl
import time

import pytest
import xxhash

from gcache.protocol import Limits, Op, auth_mac, encode_frame, read_frame
from gcache.testing.cluster import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TOKEN = "pool-tok"
LIM = Limits()


def _connect(address: str, tls_files, tls: bool) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    if tls:
        ctx = ssl.create_default_context(cafile=tls_files.ca_file)
        sock = ctx.wrap_socket(sock, server_hostname=host)
    sock.settimeout(10)
    fh, hello = read_frame(sock, LIM)
    assert fh.opcode == Op.HELLO and fh.status == 0
    sock.sendall(encode_frame(Op.AUTH, 1, {"mac": auth_mac(TOKEN, hello["nonce"])}))
    fh, meta = read_frame(sock, LIM)
    assert (fh.opcode, fh.status) == (Op.AUTH, 0), meta
    return sock


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "the server closed the connection"
        out += chunk
    return bytes(out)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_idle_after_a_put_keeps_the_connection(tls, tls_files, tmp_path):
    cl = Cluster(1, "64MiB", slab="4MiB", token=TOKEN, tls=tls_files if tls else None,
                 log_dir=str(tmp_path), extra=["--request-timeout-ms", "1000"])
    cl.start()
    try:
        sock = _connect(cl.addresses[0], tls_files, tls)
        try:
            value = os.urandom(200_000)
            sock.sendall(encode_frame(Op.PUT, 2, {
                "ns": b"pool", "items": [[b"k", len(value), 0, len(value), 0,
                                           xxhash.xxh3_64_intdigest(value)]]},
                len(value)) + value)
            fh, meta = read_frame(sock, LIM)
            assert (fh.opcode, fh.request_id, fh.status) == (Op.PUT, 2, 0), meta
            assert meta["st"] == [0]
            time.sleep(3.5)  # idle past the request deadline (1 s) and the backstop (+1 s)
            sock.sendall(encode_frame(Op.PING, 3, {}))
            fh, _ = read_frame(sock, LIM)
            assert (fh.opcode, fh.request_id, fh.status) == (Op.PING, 3, 0)
            sock.sendall(encode_frame(Op.GET, 4, {"ns": b"pool",
                                                  "items": [[b"k", 0, len(value), 0]]}))
            fh, meta = read_frame(sock, LIM)
            assert (fh.opcode, fh.request_id, fh.status) == (Op.GET, 4, 0), meta
            assert _recv_exact(sock, fh.payload_len) == value
        finally:
            sock.close()
    finally:
        cl.close()

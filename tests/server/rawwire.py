"""Hand-rolled wire protocol v1 client for server fault tests (not a test module).

``RawConn`` connects, reads HELLO and (optionally) authenticates, then lets a
test write arbitrary bytes and check how the server answers. ``raw_frame``
builds a frame with any prefix field forced (a valid CRC unless told not to).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
import zlib
from pathlib import Path

import msgpack

from gcache.protocol import MAGIC, PREFIX, PREFIX_SIZE, VERSION, Limits, Op, auth_mac, \
    encode_frame, read_frame
from gcache.sdk import Client
from gcache.status import Status

LIM = Limits()
ANY_RID = object()


def raw_frame(op: int, rid: int, header: bytes | object = b"", plen: int = 0, *,
              flags: int = 0, status: int = 0, magic: int = MAGIC, version: int = VERSION,
              hlen: int | None = None, crc: int | None = None) -> bytes:
    """prefix + header. ``header`` is raw bytes, or any object (packed as msgpack)."""
    if not isinstance(header, (bytes, bytearray)):
        header = msgpack.packb(header, use_bin_type=True)
    fixed = PREFIX.pack(magic, version, op, flags, rid, status, 0,
                        len(header) if hlen is None else hlen, plen, 0)[:PREFIX_SIZE - 4]
    if crc is None:
        crc = zlib.crc32(header, zlib.crc32(fixed))
    return fixed + crc.to_bytes(4, "little") + bytes(header)


class RawConn:
    def __init__(self, address: str, timeout: float = 5.0) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        self.sock.settimeout(timeout)
        fh, hello = read_frame(self.sock, LIM)
        assert fh.opcode == Op.HELLO and fh.is_response and fh.status == 0, (fh, hello)
        assert isinstance(hello, dict) and len(hello["nonce"]) >= 16
        self.hello = hello

    def auth(self, token: str = "", rid: int = 1, cred_id: str | None = None) -> None:
        """Authenticate with the legacy token, or (``cred_id``) a credential whose
        secret is ``token``."""
        mac = auth_mac(token, self.hello["nonce"]) if token else b""
        self.send(encode_frame(Op.AUTH, rid, {"mac": mac, **({"id": cred_id} if cred_id
                                                               else {})}))
        fh, meta = self.read()
        assert (fh.opcode, fh.request_id, fh.status) == (Op.AUTH, rid, 0), meta
        assert fh.is_response
        self.auth_reply = meta

    def send(self, *parts: bytes) -> None:
        self.sock.sendall(b"".join(parts))

    def read(self):
        return read_frame(self.sock, LIM)

    def expect_error(self, status: int, rid: object = ANY_RID, opcode: int | None = None
                     ) -> str:
        """The next frame is an error reply with ``status``; returns its message."""
        fh, meta = self.read()
        assert fh.is_response, fh
        assert fh.status == status, (Status(fh.status).name, meta)
        if rid is not ANY_RID:
            assert fh.request_id == rid, (fh, meta)
        if opcode is not None:
            assert fh.opcode == opcode, (fh, meta)
        assert fh.payload_len == 0
        assert isinstance(meta, dict) and isinstance(meta.get("error"), str) and meta["error"]
        return meta["error"]

    def expect_closed(self, timeout: float = 5.0) -> None:
        """The server closes: EOF (or a reset) and no further bytes, within ``timeout``."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            assert left > 0, "server kept the connection open"
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                return
            except socket.timeout:
                raise AssertionError("server kept the connection open") from None
            if not data:
                return
            raise AssertionError(f"unexpected bytes after the error reply: {data[:64]!r}")

    def half_close(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> "RawConn":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def server_log(cluster) -> str:
    s = cluster.servers[0]
    p = Path(s.log_dir or "") / f"{s.name}.log"
    return p.read_text(errors="replace") if s.log_dir and p.exists() else ""


def assert_serving(cluster, token: str = "") -> None:
    """The server process is alive and a fresh SDK client round-trips a value."""
    srv = cluster.servers[0]
    assert srv.alive, "server process died"
    key, value = f"probe-{uuid.uuid4().hex}", os.urandom(4096)
    with Client(servers=cluster.addresses, namespace="probe", timeout_ms=3000,
                token=token) as c:
        assert c.put(key, value) == Status.OK
        assert c.get(key) == value


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")

"""Raw-socket baseline: what plain loopback TCP does on this machine, right now.

gcache-bench prints these numbers next to its own in the same run, so a
reader can tell "gcache is slow" apart from "this box is slow".

Design: a child process (``python -m gcache.bench.raw_socket --serve``)
listens on 127.0.0.1:0, prints ``PORT <n>`` on stdout and serves exactly
one connection. Over that connection the parent sends fixed 24-byte command
headers ``<u32 op, u32 reserved, u64 a, u64 b>`` (8 bytes cannot hold a
64-bit total, hence 24), so one child serves many measurements:

=========  =====================  ===============================================
op         a, b                   what happens
=========  =====================  ===============================================
PREPARE    total, chunk           child sizes + prefills its buffer, acks u64 size
GET        total, chunk           child sends ``total`` bytes in chunks
PUT        total, chunk           parent sends ``total`` bytes; child acks u64 count
PING       size, rounds           ``rounds`` x (parent sends size, child echoes)
REQREP     size, rounds           ``rounds`` x (parent sends 64 B, child replies size)
QUIT       -                      child exits (EOF does the same)
=========  =====================  ===============================================

Buffers on both sides are allocated and prefilled *before* the clock starts
(PREPARE exists so the child's allocation is not timed) and are at most
``BUFFER_CAP`` bytes; longer transfers cycle through them, like a server
streaming from a memory pool into a client's destination buffer. One loop
(``_move``: ``sendall`` or ``recv_into`` per chunk) moves the bytes on both
sides in both directions. Stream timing runs from sending the request header
to the last byte received (GET) or to the child's ack of the last byte (PUT).
GB/s is bytes / 1e9 / s.

This module imports only the standard library so the child starts fast.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import socket
import struct
import subprocess
import sys
import time
from typing import Any, TextIO

__all__ = ["BUFFER_CAP", "REQUEST_BYTES", "RawSocketPeer", "measure_rtt", "measure_stream",
           "serve"]

BUFFER_CAP = 64 << 20
"""Largest buffer either side allocates; longer transfers reuse it cyclically."""

OP_QUIT, OP_PREPARE, OP_GET, OP_PUT, OP_PING, OP_REQREP = range(6)
REQUEST_BYTES = 64
"""What one REQREP request carries (a small GET frame's worth)."""
_HDR = struct.Struct("<IIQQ")
_U64 = struct.Struct("<Q")
_DIRECTIONS = {"get": OP_GET, "put": OP_PUT}
_RTT_WARMUP = 50


def _buffer_size(total: int, chunk: int) -> int:
    return min(total, max(chunk, BUFFER_CAP))


def _prefilled(size: int) -> bytearray:
    """A buffer whose pages are all touched (no page faults while timing)."""
    return bytearray(b"\xa5") * size


def _move(sock: socket.socket, view: memoryview, total: int, chunk: int, send: bool) -> None:
    """Send or receive ``total`` bytes in ``chunk``-byte pieces, cycling through ``view``."""
    off, remaining = 0, total
    while remaining:
        n = min(chunk, remaining)
        if off + n > len(view):
            off = 0
        if send:
            sock.sendall(view[off:off + n])
            got = n
        else:
            got = sock.recv_into(view[off:off + n])
            if got == 0:
                raise ConnectionError("peer closed the connection mid-transfer")
        off += got
        remaining -= got


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    _move(sock, view, len(view), len(view), send=False)


def _recv_u64(sock: socket.socket) -> int:
    ack = bytearray(_U64.size)
    _recv_exact(sock, memoryview(ack))
    return _U64.unpack(ack)[0]


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _stream_op(total_bytes: int, chunk_bytes: int, direction: str) -> int:
    """Check a stream's arguments; its op."""
    _positive("total_bytes", total_bytes)
    _positive("chunk_bytes", chunk_bytes)
    if direction not in _DIRECTIONS:
        raise ValueError(f"direction must be 'get' or 'put', got {direction!r}")
    return _DIRECTIONS[direction]


# --------------------------------------------------------------------------- child


def _serve_connection(sock: socket.socket) -> None:
    """Run the parent's commands on one accepted connection until QUIT or EOF."""
    buf = bytearray()
    header = memoryview(bytearray(_HDR.size))
    while True:
        first = sock.recv_into(header)
        if first == 0:
            return  # parent closed: normal exit
        _recv_exact(sock, header[first:])
        op, _reserved, a, b = _HDR.unpack(header)
        if op == OP_QUIT:
            return
        if op not in (OP_PREPARE, OP_GET, OP_PUT, OP_PING, OP_REQREP):
            raise ValueError(f"unknown op {op}")
        size = max(a, REQUEST_BYTES) if op in (OP_PING, OP_REQREP) else _buffer_size(a, b)
        if len(buf) < size:
            buf = bytearray()  # free the old one first
            buf = _prefilled(size)
        view = memoryview(buf)
        if op == OP_PREPARE:
            sock.sendall(_U64.pack(size))
        elif op == OP_GET:
            _move(sock, view, a, b, send=True)
        elif op == OP_PUT:
            _move(sock, view, a, b, send=False)
            sock.sendall(_U64.pack(a))
        elif op == OP_PING:
            for _ in range(b):
                _recv_exact(sock, view[:a])
                sock.sendall(view[:a])
        else:
            for _ in range(b):
                _recv_exact(sock, view[:REQUEST_BYTES])
                sock.sendall(view[:a])


def serve(host: str = "127.0.0.1", port: int = 0, accept_timeout: float = 30.0,
          out: TextIO | None = None) -> int:
    """Child entry point: listen, announce ``PORT <n>``, serve one connection.

    Returns a process exit code (1 if nobody connected in time).
    """
    out = sys.stdout if out is None else out
    with socket.create_server((host, port)) as lsock:
        lsock.settimeout(accept_timeout)
        print(f"PORT {lsock.getsockname()[1]}", file=out, flush=True)
        try:
            conn, _ = lsock.accept()
        except TimeoutError:
            return 1
    with conn:
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            _serve_connection(conn)
        except (ConnectionError, BrokenPipeError):
            return 0  # parent went away; nothing to report
    return 0


# --------------------------------------------------------------------------- parent


class RawSocketPeer:
    """A running baseline child plus the connection to it.

    Use as a context manager; ``close()`` always reaps the child (QUIT, then
    terminate, then kill, each with a timeout). Any failure during a
    measurement closes the peer, since the stream is then out of sync.
    """

    def __init__(self, *, timeout: float = 30.0, startup_timeout: float = 15.0) -> None:
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._buf = bytearray()
        self._child_buf = 0

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self._proc

    @property
    def closed(self) -> bool:
        return self._sock is None

    def __enter__(self) -> RawSocketPeer:
        if self.closed:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Spawn the child (its stderr is ours) and connect to it."""
        if self._proc is not None:
            raise RuntimeError("peer already started")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "gcache.bench.raw_socket", "--serve",
             "--accept-timeout", str(self.startup_timeout)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env)
        try:
            sock = socket.create_connection(("127.0.0.1", self._read_port(self._proc)),
                                            timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        except BaseException:
            self.close()
            raise

    def _read_port(self, proc: subprocess.Popen[bytes]) -> int:
        """The child's ``PORT <n>`` line, within the startup timeout."""
        deadline = time.monotonic() + self.startup_timeout
        while (left := deadline - time.monotonic()) > 0:
            if select.select([proc.stdout], [], [], min(left, 0.5))[0]:
                line = proc.stdout.readline().decode(errors="replace")
                if line.startswith("PORT "):
                    return int(line.split()[1])
            if proc.poll() is not None:
                raise RuntimeError(f"raw-socket child exited early (exit code "
                                   f"{proc.returncode}; its stderr is above)")
        raise TimeoutError(f"raw-socket child did not start in {self.startup_timeout}s")

    def close(self) -> None:
        """Stop the child: QUIT, close, then terminate/kill if it lingers."""
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.settimeout(1.0)
                sock.sendall(_HDR.pack(OP_QUIT, 0, 0, 0))
            except OSError:
                pass
            sock.close()
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5.0)
        finally:
            if proc.stdout is not None:
                proc.stdout.close()

    def _conn(self) -> socket.socket:
        if self._sock is None:
            raise RuntimeError("peer is not running (closed or never started)")
        return self._sock

    def _prepare(self, sock: socket.socket, total: int, chunk: int) -> None:
        """Have the child allocate and prefill its buffer for a transfer (untimed)."""
        if _buffer_size(total, chunk) > self._child_buf:
            sock.sendall(_HDR.pack(OP_PREPARE, 0, total, chunk))
            self._child_buf = _recv_u64(sock)

    def _local_buffer(self, size: int) -> memoryview:
        if len(self._buf) < size:
            self._buf = bytearray()  # free the old one first
            self._buf = _prefilled(size)
        return memoryview(self._buf)[:size]

    def stream(self, total_bytes: int, chunk_bytes: int, direction: str = "get") -> dict[str, Any]:
        """Time one bulk transfer of ``total_bytes`` in ``chunk_bytes`` pieces."""
        op = _stream_op(total_bytes, chunk_bytes, direction)
        total, chunk = total_bytes, chunk_bytes
        sock = self._conn()
        try:
            view = self._local_buffer(_buffer_size(total, chunk))
            self._prepare(sock, total, chunk)
            t0 = time.perf_counter_ns()
            sock.sendall(_HDR.pack(op, 0, total, chunk))
            _move(sock, view, total, chunk, send=op == OP_PUT)
            moved = _recv_u64(sock) if op == OP_PUT else total
            seconds = max(time.perf_counter_ns() - t0, 1) / 1e9
        except BaseException:
            self.close()
            raise
        if moved != total:
            self.close()
            raise ConnectionError(f"transferred {moved} bytes, expected {total}")
        return {"direction": direction, "chunk_bytes": chunk, "total_bytes": moved,
                "seconds": seconds, "gbps": moved / 1e9 / seconds}

    def rtt(self, size: int = 64, iterations: int = 2000) -> dict[str, Any]:
        """Ping-pong ``size`` bytes ``iterations`` times (after a short warmup)."""
        return self._round_trips(OP_PING, size, size, iterations)

    def request_reply(self, size: int, iterations: int = 2000) -> dict[str, Any]:
        """``iterations`` requests of 64 B, each answered by ``size`` bytes: what a
        single-key get of ``size`` costs on a plain socket (after a short warmup)."""
        return self._round_trips(OP_REQREP, REQUEST_BYTES, size, iterations)

    def _round_trips(self, op: int, out_size: int, size: int, iterations: int
                     ) -> dict[str, Any]:
        """Send ``out_size`` bytes, read ``size`` back, ``iterations`` times; latency."""
        _positive("size", size)
        _positive("iterations", iterations)
        sock = self._conn()
        try:
            self._prepare(sock, max(size, REQUEST_BYTES), max(size, REQUEST_BYTES))
            payload = self._local_buffer(out_size + size)
            out, back = payload[:out_size], payload[out_size:]
            samples: list[int] = []
            clock = time.perf_counter_ns
            sock.sendall(_HDR.pack(op, 0, size, iterations + _RTT_WARMUP))
            for i in range(iterations + _RTT_WARMUP):
                t0 = clock()
                sock.sendall(out)
                _recv_exact(sock, back)
                if i >= _RTT_WARMUP:
                    samples.append(clock() - t0)
        except BaseException:
            self.close()
            raise
        samples.sort()
        return {"size": size, "iterations": iterations,
                "p50_us": _percentile(samples, 50) / 1e3,
                "p99_us": _percentile(samples, 99) / 1e3,
                "mean_us": sum(samples) / len(samples) / 1e3,
                "min_us": samples[0] / 1e3, "max_us": samples[-1] / 1e3}


def _percentile(sorted_samples: list[int], p: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    rank = max(1, math.ceil(p / 100 * len(sorted_samples)))
    return float(sorted_samples[rank - 1])


def measure_stream(total_bytes: int, chunk_bytes: int, direction: str = "get", *,
                   peer: RawSocketPeer | None = None, timeout: float = 30.0) -> dict[str, Any]:
    """Loopback TCP throughput of one transfer.

    Returns ``{"direction", "chunk_bytes", "total_bytes", "seconds", "gbps"}``.
    Starts (and always reaps) a child unless ``peer`` is given.
    """
    if peer is not None:
        return peer.stream(total_bytes, chunk_bytes, direction)
    _stream_op(total_bytes, chunk_bytes, direction)  # bad arguments spawn nothing
    with RawSocketPeer(timeout=timeout) as own:
        return own.stream(total_bytes, chunk_bytes, direction)


def measure_rtt(size: int = 64, iterations: int = 2000, *, peer: RawSocketPeer | None = None,
                timeout: float = 30.0) -> dict[str, Any]:
    """Loopback TCP ping-pong latency: ``{"size", "iterations", "p50_us", "p99_us",
    "mean_us", "min_us", "max_us"}``. Starts (and reaps) a child unless ``peer``."""
    if peer is not None:
        return peer.rtt(size, iterations)
    _positive("size", size)
    _positive("iterations", iterations)
    with RawSocketPeer(timeout=timeout) as own:
        return own.rtt(size, iterations)


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gcache.bench.raw_socket",
        description="Loopback TCP baseline (throughput and ping-pong latency).")
    parser.add_argument("--serve", action="store_true", help="run as the child server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--accept-timeout", type=float, default=30.0)
    parser.add_argument("--total-bytes", type=int, default=256 << 20)
    parser.add_argument("--chunk-bytes", type=int, action="append")
    parser.add_argument("--rtt-size", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=2000)
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.host, args.port, args.accept_timeout)
    results: list[dict[str, Any]] = []
    with RawSocketPeer() as peer:
        for chunk in args.chunk_bytes or [64 << 10, 1 << 20, 4 << 20]:
            for direction in ("get", "put"):
                results.append(peer.stream(args.total_bytes, chunk, direction))
        results.append(peer.rtt(args.rtt_size, args.iterations))
    json.dump(results, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

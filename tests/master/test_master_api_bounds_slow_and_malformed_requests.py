"""The master's HTTP API bounds what a peer without the token can hold: a malformed
Content-Length is a quick 400, a request must arrive whole within one deadline (a peer
trickling bytes is cut off), connections are capped, and the /view long-poll still works.

Real gcache-master processes; the hostile peers are raw sockets in the test.
"""

from __future__ import annotations

import socket
import time

import pytest

from gcache.discovery import MasterClient
from gcache.testing.cluster import MasterProc, free_port_pair
from gcache.testing.waiting import wait_for as _wait_for

pytestmark = [pytest.mark.integration, pytest.mark.faults]

TOKEN = "api-limits-token"
# headers never finished (no token needed to send this) ...
HALF_HEADERS = b"POST /heartbeat HTTP/1.1\r\nHost: m\r\nContent-Length: 100\r\n"
# ... and, with the token, headers done but the body never finished
HALF_BODY = (b"POST /heartbeat HTTP/1.1\r\nHost: m\r\nAuthorization: Bearer " + TOKEN.encode() +
             b"\r\nContent-Length: 100\r\n\r\n{\"id\": ")


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError("no Threads line")


def connect(addr: str, timeout: float = 5.0) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def read_until_close(s: socket.socket) -> bytes:
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return out
        out += chunk


def wait_for(pred, timeout: float):
    return _wait_for(pred, timeout, step=0.1, retry_on=())


def start_master(tmp_path, name: str, extra: list[str] | None = None) -> MasterProc:
    m = MasterProc(name, free_port_pair(), [], str(tmp_path / name), token=TOKEN,
                   log_dir=str(tmp_path), extra=extra)
    m.start()
    return m


@pytest.fixture
def master(tmp_path):
    m = start_master(tmp_path, "m-default")
    yield m
    m.terminate()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("length", [b"-1", b"-100000", b"abc", b"+5", b"1e3", b" 5 5"])
def test_malformed_content_length_is_a_quick_400(master, length):
    with connect(master.address) as s:
        s.sendall(b"POST /register HTTP/1.1\r\nHost: m\r\nAuthorization: Bearer " +
                  TOKEN.encode() + b"\r\nContent-Length: " + length + b"\r\n\r\n{}")
        t0 = time.monotonic()
        reply = read_until_close(s)  # answered and closed, never read until EOF
    # the status line of an unparsable request may say HTTP/1.0: the code is the contract
    assert reply.split(b" ", 2)[1] == b"400", reply[:200]
    assert b"Content-Length" in reply
    assert time.monotonic() - t0 < 3.0


@pytest.mark.timeout(60)
def test_a_trickled_request_is_cut_off_by_the_request_deadline(master):
    """One byte every 0.4 s: every recv succeeds, so only a real deadline (5 s) ends it."""
    request = (b"GET /view HTTP/1.1\r\nHost: m\r\nAuthorization: Bearer " + TOKEN.encode() +
               b"\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n")
    with connect(master.address) as s:
        s.settimeout(0.4)
        t0 = time.monotonic()
        closed_after = None
        for byte in request:
            try:
                s.sendall(bytes([byte]))
                if s.recv(65536) == b"":
                    closed_after = time.monotonic() - t0
                    break
            except TimeoutError:
                continue
            except OSError:  # reset: closed
                closed_after = time.monotonic() - t0
                break
            if time.monotonic() - t0 > 25:
                break
    assert closed_after is not None, "a peer trickling bytes kept its connection for 25 s"
    assert 4.0 <= closed_after < 12.0, closed_after
    assert MasterClient([master.address], TOKEN).view()["epoch"] >= 0


@pytest.mark.timeout(90)
def test_half_sent_requests_are_closed_and_release_their_threads(master):
    base = threads_of(master.proc.pid)
    socks = [connect(master.address) for _ in range(150)]
    try:
        for i, s in enumerate(socks):
            s.sendall(HALF_BODY if i % 2 else HALF_HEADERS)
        # a legitimate client is served at once meanwhile
        t0 = time.monotonic()
        assert MasterClient([master.address], TOKEN, timeout_s=3.0).view()["epoch"] >= 0
        assert time.monotonic() - t0 < 3.0
        # within the deadline (5 s) plus slack every half-sent request is closed (a 408 when
        # its headers were in), and its thread is gone
        for s in socks:
            s.settimeout(15)
        replies = [read_until_close(s) for s in socks]
        assert all(r == b"" for r in replies[0::2]), {r[:40] for r in replies[0::2]}
        assert all(r.startswith(b"HTTP/1.1 408") for r in replies[1::2]), \
            {r[:40] for r in replies[1::2]}
        wait_for(lambda: threads_of(master.proc.pid) <= base + 3, 10)
    finally:
        for s in socks:
            s.close()


@pytest.mark.timeout(90)
def test_connections_beyond_the_cap_are_refused_not_given_threads(tmp_path):
    m = start_master(tmp_path, "m-capped", ["--max-connections", "32",
                                            "--request-deadline-ms", "3000"])
    socks: list[socket.socket] = []
    try:
        base = threads_of(m.proc.pid)
        for _ in range(150):
            s = connect(m.address)
            s.sendall(HALF_HEADERS)
            socks.append(s)
        time.sleep(0.5)
        assert threads_of(m.proc.pid) <= base + 32 + 3, "one thread per connection past the cap"
        refused = 0
        for s in socks:
            s.settimeout(0.2)
            try:
                data = s.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                refused += 1
                continue
            if data.startswith(b"HTTP/1.1 503") or data == b"":
                refused += 1
        assert refused >= 150 - 32 - 5, refused
        for s in socks:
            s.close()
        socks.clear()
        # once the cap has room again (the deadline frees the held slots), clients are served
        mc = MasterClient([m.address], TOKEN, timeout_s=2.0)
        wait_for(lambda: mc.view()["epoch"] >= 0, 10)
    finally:
        for s in socks:
            s.close()
        m.terminate()


@pytest.mark.timeout(60)
def test_view_long_poll_outlives_the_request_deadline(tmp_path):
    m = start_master(tmp_path, "m-poll", ["--request-deadline-ms", "1000"])
    try:
        mc = MasterClient([m.address], TOKEN, timeout_s=2.0)
        epoch = mc.view()["epoch"]
        t0 = time.monotonic()
        doc = mc.view(since=epoch, wait_ms=3000)
        waited = time.monotonic() - t0
        assert doc["epoch"] == epoch
        assert 2.5 <= waited < 6.0, waited
    finally:
        m.terminate()

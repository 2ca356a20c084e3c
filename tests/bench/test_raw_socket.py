"""Tests for gcache.bench.raw_socket: the loopback TCP baseline."""

from __future__ import annotations

import os
import signal

import pytest

from gcache.bench.raw_socket import RawSocketPeer, measure_rtt, measure_stream

pytestmark = pytest.mark.timeout(30)

MIB = 1 << 20


@pytest.mark.parametrize("direction", ["get", "put"])
def test_measure_stream_64mib(direction: str) -> None:
    r = measure_stream(64 * MIB, 1 * MIB, direction)
    assert set(r) == {"direction", "chunk_bytes", "total_bytes", "seconds", "gbps"}
    assert r["direction"] == direction
    assert r["total_bytes"] == 64 * MIB
    assert r["chunk_bytes"] == MIB
    assert r["seconds"] > 0
    assert r["gbps"] > 0
    assert r["gbps"] == pytest.approx(64 * MIB / 1e9 / r["seconds"])


def test_measure_rtt_percentiles() -> None:
    r = measure_rtt(64, 500)
    assert r["size"] == 64 and r["iterations"] == 500
    assert 0 < r["min_us"] <= r["p50_us"] <= r["p99_us"] <= r["max_us"]


def test_one_child_serves_many_measurements() -> None:
    with RawSocketPeer() as peer:
        pid = peer.pid
        odd = measure_stream(3 * MIB + 17, 64 * 1024 + 3, "get", peer=peer)  # ragged sizes
        assert odd["total_bytes"] == 3 * MIB + 17
        assert peer.stream(5 * MIB + 1, 7 * MIB, "put")["total_bytes"] == 5 * MIB + 1
        assert peer.stream(1, 1, "get")["total_bytes"] == 1
        assert measure_rtt(4096, 100, peer=peer)["p50_us"] > 0
        assert peer.stream(8 * MIB, MIB, "put")["total_bytes"] == 8 * MIB
        assert peer.pid == pid
        proc = peer.process
    assert peer.closed
    assert proc is not None and proc.returncode is not None  # reaped


def test_bad_arguments_raise_before_spawning() -> None:
    with pytest.raises(ValueError):
        measure_stream(MIB, MIB, "sideways")
    with pytest.raises(ValueError):
        measure_stream(0, MIB)
    with pytest.raises(ValueError):
        measure_stream(MIB, 0, "put")
    with pytest.raises(ValueError):
        measure_rtt(0)
    with pytest.raises(ValueError):
        measure_rtt(64, 0)


def test_child_is_reaped_when_it_dies_mid_run() -> None:
    peer = RawSocketPeer(timeout=5.0)
    peer.start()
    proc = peer.process
    assert proc is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=5)
    with pytest.raises(OSError):  # ConnectionError / BrokenPipeError / reset
        peer.stream(64 * MIB, MIB, "get")
    assert peer.closed
    assert peer.process is None
    with pytest.raises(RuntimeError):
        peer.stream(MIB, MIB, "get")


def test_close_is_idempotent_and_reaps_child() -> None:
    peer = RawSocketPeer()
    peer.start()
    proc = peer.process
    peer.close()
    peer.close()
    assert proc is not None and proc.returncode == 0


@pytest.mark.unit
def test_request_reply_carries_the_reply_size_on_one_child() -> None:
    """The single-get baseline: 64 B out, ``size`` back, on the same child as the
    streams and the RTT; a reply short of ``size`` would hang, so it would time out."""
    with RawSocketPeer() as peer:
        small = peer.request_reply(64, 200)
        big = peer.request_reply(256 << 10, 100)
        assert measure_rtt(64, 100, peer=peer)["p50_us"] > 0  # the stream is still in sync
    assert small["size"] == 64 and big["size"] == 256 << 10
    assert big["iterations"] == 100
    assert 0 < small["p50_us"] and 0 < big["p50_us"] <= big["p99_us"]

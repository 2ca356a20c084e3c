"""Callbacks at CUDA-stream granularity (Client(stream=...)) against a real server.

No GPU here: the watcher is driven by a stand-in stream whose progress the test
controls (``record`` remembers how much work was enqueued, ``query`` says whether
the stream has done that much), which is the contract of ``torch.cuda.Event``.
The real-CUDA test runs where ``torch.cuda.is_available()``.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gcache.sdk import Client, Status

pytestmark = pytest.mark.integration


class Stream:
    def __init__(self) -> None:
        self.enqueued = 0  # work items put on the stream
        self.done = 0  # work items the "GPU" finished

    def enqueue(self) -> None:
        self.enqueued += 1


class Event:
    def __init__(self) -> None:
        self.stream: Stream | None = None
        self.mark = 0

    def record(self, stream: Stream) -> None:
        self.stream, self.mark = stream, stream.enqueued

    def query(self) -> bool:
        return self.stream.done >= self.mark


@pytest.fixture
def client(cluster):
    with Client(cluster.addresses, transport="tcp", timeout_ms=3000) as c:
        c._streams.event_factory = Event
        yield c


def test_put_waits_for_the_stream(client):
    s = Stream()
    s.enqueue()  # the kernel that fills the page
    v = np.arange(4096, dtype=np.uint8)
    keys_done: list[int] = []
    fut = client.put_batch_from_async(["p"], [v], stream=s,
                                      on_key=lambda i, k, st: keys_done.append(i))
    time.sleep(0.3)
    assert not fut.done() and client.exists("p") is False and keys_done == []
    s.done = 1  # the stream reaches the put
    assert fut.result(5) == [Status.OK] and keys_done == [0]
    assert client.get("p") == v.tobytes()


def test_put_whose_stream_never_gets_there_times_out_once(client):
    s = Stream()
    s.enqueue()
    calls: list[list] = []
    t0 = time.monotonic()
    fut = client.put_batch_from_async(["q", "r"], [b"x", b"y"], stream=s, timeout_ms=400,
                                      callback=calls.append)
    assert fut.result(5) == [Status.TIMEOUT, Status.TIMEOUT]
    assert 0.35 < time.monotonic() - t0 < 3 and calls == [[Status.TIMEOUT, Status.TIMEOUT]]
    assert client.exists("q") is False


def test_get_completes_after_the_stream_passes_the_landing_point(client):
    vals = [np.full(8192, i, dtype=np.uint8) for i in range(4)]
    keys = [f"g{i}" for i in range(4)]
    assert client.put_batch_from(keys, vals) == [Status.OK] * 4
    s = Stream()
    s.enqueue()  # the engine's earlier work on this stream, still running
    per_key = threading.Event()
    seen: list[int] = []

    def on_key(i, k, st):
        seen.append(i)
        if len(seen) == 4:
            per_key.set()

    batch: list[list] = []
    outs = [np.zeros(8192, np.uint8) for _ in range(4)]
    fut = client.get_batch_into_async(keys, outs, stream=s, on_key=on_key, callback=batch.append)
    assert per_key.wait(5)  # every key landed and was reported per key
    time.sleep(0.2)
    assert not fut.done() and batch == []  # the batch waits for the stream
    s.done = 1
    assert fut.result(5) == [Status.OK] * 4 and batch == [[Status.OK] * 4]
    assert all(np.array_equal(o, v) for o, v in zip(outs, vals))


def test_stream_without_cuda_is_a_clear_error(cluster):
    import torch

    if torch.cuda.is_available():  # pragma: no cover - GPU hosts
        pytest.skip("CUDA present")
    with Client(cluster.addresses, transport="tcp") as c:
        with pytest.raises(ValueError, match="CUDA"):
            c.get_batch_into_async(["a"], [np.zeros(1, np.uint8)], stream=object())
        with pytest.raises(ValueError, match="CUDA"):
            c.put_batch_from_async(["a"], [b"x"], stream=object())


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs CUDA")
def test_real_cuda_stream(cluster):  # pragma: no cover - no GPU on CI
    import torch

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t = torch.arange(1 << 16, device="cuda").to(torch.uint8)
        host = t.to("cpu", non_blocking=True)  # D2H on s; the put starts after it
    with Client(cluster.addresses, transport="tcp") as c:
        assert c.put_batch_from_async(["c"], [host], stream=s).result(10) == [Status.OK]
        assert c.get("c") == bytes(t.cpu().numpy())

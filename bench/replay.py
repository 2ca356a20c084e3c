"""Replay a KV-page workload (sessions or a Mooncake trace) through the SDK.

Each step does what an inference engine's L3 tier does for one request:
``exists_batch`` over the prompt's page chain gives the reusable prefix,
``get_batch_into`` reads that prefix into preallocated page buffers (checked
against the value oracle, so a wrong byte is counted, never hidden), and
``put_batch_from`` stores the pages that were missing (naming the page before them,
``chain_parent``, for the ``chains`` eviction policy). A prefix page that
``exists`` said was there but then failed to read truncates the hit (and is
counted as ``lost_after_exists``).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from gcache.sdk import Client, Status
from gcache.testing.oracle import check_value, fill_value
from gcache.bench.workload import Step


@dataclass
class ReplayReport:
    source: str
    page_bytes: int
    block_tokens: int
    steps: int = 0
    pages: int = 0
    pages_hit: int = 0
    pages_put: int = 0
    bytes_put: int = 0
    bytes_got: int = 0
    wrong_values: int = 0
    lost_after_exists: int = 0
    put_failures: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    step_us: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.pages_hit / self.pages if self.pages else 0.0

    def summary(self) -> dict:
        lat = np.array(self.step_us) if self.step_us else np.zeros(1)
        moved = self.bytes_put + self.bytes_got
        return {
            "source": self.source, "steps": self.steps, "pages": self.pages,
            "tokens": self.pages * self.block_tokens,
            "token_hit_rate": round(self.hit_rate, 4),
            "pages_hit": self.pages_hit, "pages_put": self.pages_put,
            "bytes_put": self.bytes_put, "bytes_got": self.bytes_got,
            "seconds": round(self.seconds, 3),
            "gbps": round(moved / 1e9 / self.seconds, 3) if self.seconds else 0.0,
            "steps_per_s": round(self.steps / self.seconds, 1) if self.seconds else 0.0,
            "step_p50_ms": round(float(np.percentile(lat, 50)) / 1000, 3),
            "step_p99_ms": round(float(np.percentile(lat, 99)) / 1000, 3),
            "wrong_values": self.wrong_values, "lost_after_exists": self.lost_after_exists,
            "put_failures": dict(self.put_failures),
        }


def replay(client: Client, steps: Iterator[Step], *, source: str, block_tokens: int,
           page_bytes: int, concurrency: int = 4, limit: int | None = None,
           on_step: Callable[[ReplayReport], None] | None = None) -> ReplayReport:
    """Run the steps with ``concurrency`` engine threads; returns the report."""
    rep = ReplayReport(source, page_bytes, block_tokens)
    lock = threading.Lock()
    it = iter(steps)
    taken = [0]

    def next_step() -> Step | None:
        with lock:
            if limit is not None and taken[0] >= limit:
                return None
            try:
                s = next(it)
            except StopIteration:
                return None
            taken[0] += 1
            return s

    def engine() -> None:
        pool: list[np.ndarray] = []
        while (step := next_step()) is not None:
            keys = list(step.page_keys)
            while len(pool) < len(keys):
                pool.append(np.empty(page_bytes, dtype=np.uint8))
            t0 = time.perf_counter()
            present = client.exists_batch(keys)
            hit = next((i for i, p in enumerate(present) if not p), len(keys))
            wrong = lost = 0
            if hit:
                st = client.get_batch_into(keys[:hit], pool[:hit])
                ok = next((i for i, s in enumerate(st) if s != Status.OK), hit)
                lost = hit - ok
                hit = ok
                wrong = sum(not check_value(k, pool[i]) for i, k in enumerate(keys[:hit]))
            todo = keys[hit:]
            for i, k in enumerate(todo):
                fill_value(k, pool[i])
            # the trace knows the chain: name the page before the first one put
            st = client.put_batch_from(todo, pool[:len(todo)],
                                       chain_parent=keys[hit - 1] if hit else b"") \
                if todo else []
            dt = (time.perf_counter() - t0) * 1e6
            with lock:
                rep.steps += 1
                rep.pages += len(keys)
                rep.pages_hit += hit
                rep.pages_put += sum(s == Status.OK for s in st)
                rep.bytes_got += hit * page_bytes
                rep.bytes_put += len(todo) * page_bytes
                rep.wrong_values += wrong
                rep.lost_after_exists += lost
                for s in st:
                    if s != Status.OK:
                        rep.put_failures[s.name] += 1
                rep.step_us.append(dt)
            if on_step is not None:
                on_step(rep)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=engine, name=f"engine-{i}") for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rep.seconds = time.perf_counter() - t0
    return rep

"""The SDK's own Prometheus metrics, when the caller asks for them
(``Client(metrics=True)`` or ``Client(metrics=registry)``):

* ``gcache_client_items_total{op, result}``: keys of finished calls, by op (get, put,
  exists, delete, touch) and result: ``hit`` (a read found), ``ok`` (a write, delete or
  touch done), or the miss's cause, the status name in lower case (``miss``: not
  stored; ``timeout``: the call's deadline passed; ``unavailable``: no server reachable;
  ``corrupt``: a checksum failed; ``busy``, ``no_space``, ``conflict``, ``auth``,
  ``error``, ``closed``, ...);
* ``gcache_client_op_seconds{op, transport}``: wall time of a call, from its start to
  its last key's result (the configured transport: tcp, shm, nixl or auto).

Every client of a process that passes the same registry shares these series (a
registry takes each name once). They are counted when a call completes, on the thread
that completed it (a dispatch thread, the reaper, or the caller of a one-hop call),
before its future is resolved or a synchronous call returns: a counter increment per
distinct result and one histogram observation per call, nothing per key beyond a pass
over the results.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter as Tally
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from gcache.protocol import Op
from gcache.status import Status

_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
            1.0, 2.5, 5.0)
_NAMES = {Op.GET: "get", Op.PUT: "put", Op.EXISTS: "exists", Op.DELETE: "delete",
          Op.TOUCH: "touch"}
_lock = threading.Lock()
# registry -> its metrics (one set per registry). Weak keys: keyed by id(), a registry
# made after another was freed could get its id and be handed metrics that count into
# the freed one
_shared: weakref.WeakKeyDictionary[CollectorRegistry, SdkMetrics] = \
    weakref.WeakKeyDictionary()


def _result(st: Status, read: bool) -> str:
    """A finished key's ``result`` label: ``hit`` (a read found it), ``ok``, or the
    miss's cause."""
    return "hit" if st == Status.OK and read else "ok" if st == Status.OK else st.name.lower()


class SdkMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.items = Counter("gcache_client_items", "Keys of finished SDK calls, by op and "
                             "result (hit, ok, or the miss's cause)", ["op", "result"],
                             registry=registry)
        self.seconds = Histogram("gcache_client_op_seconds", "Wall time of an SDK call, "
                                 "start to last result, by op and transport",
                                 ["op", "transport"], buckets=_BUCKETS, registry=registry)

    @staticmethod
    def for_registry(registry: CollectorRegistry | bool) -> SdkMetrics:
        """The metrics of ``registry`` (``True``: prometheus_client's default one),
        made on first use."""
        reg = REGISTRY if registry is True else registry
        with _lock:
            m = _shared.get(reg)
            if m is None:
                m = _shared[reg] = SdkMetrics(reg)
            return m

    def count_one(self, op: int, transport: str, status: Status, seconds: float) -> None:
        """Count a one-key call answered without a batch (``sdk/point.py``) as ``watch``
        counts a batch's key: ``hit`` (a read found it), ``ok``, or the miss's cause."""
        name = _NAMES.get(op, str(op))
        self.items.labels(name, _result(status, op in (Op.GET, Op.EXISTS))).inc()
        self.seconds.labels(name, transport).observe(seconds)

    def watch(self, batch: Any, transport: str, started: float,
              clock: Callable[[], float]) -> None:
        """Count ``batch``'s results and time when it completes: on the completing
        thread, before its future is resolved, so a synchronous call returns only once it
        is counted (a Future's done callbacks run after its waiters wake)."""
        op = _NAMES.get(batch.op, str(batch.op))
        read = batch.op in (Op.GET, Op.EXISTS)

        def count(results: list) -> None:
            tally: Tally[str] = Tally()
            for i, r in enumerate(results):
                if isinstance(r, Status):
                    st = r
                elif r is None or r is False:  # get_batch / exists: a miss, cause below
                    st = batch.left[i] if batch.left[i] != Status.OK else Status.MISS
                else:  # bytes, True: found
                    st = Status.OK
                tally[_result(st, read)] += 1
            for result, n in tally.items():
                self.items.labels(op, result).inc(n)
            self.seconds.labels(op, transport).observe(clock() - started)

        if batch.done:  # no keys: complete from the start
            count(batch.results)
        else:
            batch.watcher = count

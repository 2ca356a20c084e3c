"""Prometheus metrics and the HTTP endpoint (/metrics, /healthz, /readyz) of one server.

Counters are updated per frame (not per key) on the hot path; tier gauges and
counters are read from the tier's ``stats()`` at scrape time (the same dict the
STATS reply and the master heartbeat carry): ``gcache_memory_*`` for the
memory tier, ``gcache_disk_*`` for the NVMe tier, ``gcache_tier_*`` for
movement between them, and ``gcache_tier_{capacity,used}_bytes{tier=...}``
side by side. ``gcache_handoff_*`` (servers with masters) are the handoff worker's:
counters of objects and bytes moved, objects lost and passes run, and gauges of the
current pass (objects and bytes left, objects waiting for a retry, active);
``gcache_self_drain{reason}`` is 1 for the reason the server drained itself
(``self_drain.py``: stop, unhealthy_file, disk_degraded), 0 for the others.
``gcache_stale_dropped`` (servers with masters) counts objects of mutable namespaces the
freshness rule dropped; ``gcache_put_if_absent_tombstoned`` the if-absent put items
skipped for a recent delete, ``gcache_tombstones`` the deletes remembered.

The miss-ratio curve (``server/mrc.py``; off with ``--mrc false``):
``gcache_mrc_hit_ratio{namespace, capacity_factor}`` and
``gcache_mrc_byte_hit_ratio{namespace, capacity_factor}`` are the estimated memory hit
ratios of GETs (of GET bytes) were memory ``capacity_factor`` (0.5, 1, 2, 4, 8) times its
size (an EXISTS counts as the read it decides); ``gcache_mrc_actual_hit_ratio{namespace}``
is what memory served for the same sampled reads and ``gcache_mrc_gets{namespace}`` how
many reads the estimate stands for.
Namespace ``*`` is all of them, next to the 8 with the most GETs (past 16 distinct
namespaces, later ones count as ``other``) that also have a label of their own in the
per-namespace series below (ratios of the rest cannot be summed under ``other``).
``gcache_mrc_sample_rate`` and ``gcache_mrc_tracked_keys`` describe the sample.

Per-namespace counters (``gcache_namespace_{hits,misses,bytes}_total``) carry a
``namespace`` label. Namespaces are client-chosen strings, so the label set is
bounded: the first ``max_namespaces`` distinct namespaces a server sees keep their
own label for its lifetime and every later one is counted under ``other``
(``NamespaceLabels``). Scope refusals (``gcache_auth_refused_total``) are labelled
by credential id, which the operator's credentials file bounds, and op.

Quotas (``gcache.quotas``): ``gcache_namespace_used_bytes{namespace, tier}`` and
``gcache_namespace_quota_bytes{namespace, tier}`` (only for namespaces with a limit on
that tier) are read from the tier at scrape time and summed per label, so namespaces
past the label limit add up under ``other`` (which has no quota gauge);
``gcache_namespace_quota_refused_total{namespace}`` counts puts refused at the
namespace's memory quota and ``gcache_namespace_quota_evictions_total{namespace, tier}``
objects evicted (memory) or records killed or dropped (disk) to keep it within quota.

Two objects. ``ServerMetrics`` holds the counters the tiers and the service update; it
is built first and reads nothing. ``MetricsEndpoint`` is built last, from the counters
and the functions it reads at scrape time (the server's ``stats``, the tier's
``namespace_usage``, the quotas, the health document): it binds its port at
construction, serves from ``start`` (aiohttp on one event-loop thread, at most
``MAX_CONNECTIONS`` connections and ``MAX_CONNECTIONS_PER_IP`` per peer address, 503 past
a cap; a request must arrive whole within ``REQUEST_DEADLINE_S``:
``gcache.bounded_aiohttp``) and releases the port in ``stop`` (owner's thread; bounded,
a few seconds at most).
Scrape-time collectors run on one of ``SCRAPE_WORKERS`` pool threads and must not block.
"""

from __future__ import annotations

import itertools
import json
import ssl
import threading
from bisect import bisect_left
from typing import TYPE_CHECKING, Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.utils import floatToGoString

from gcache.process_metrics import add_process_metrics
from gcache.server.self_drain import DrainReason
from gcache.server.startup import Phase

if TYPE_CHECKING:
    from aiohttp import web

# What one scraper or prober may hold on the metrics port: a request must arrive whole
# within REQUEST_DEADLINE_S (one deadline, not per recv), and at most MAX_CONNECTIONS
# connections are served at once, MAX_CONNECTIONS_PER_IP from one address (503 past it).
REQUEST_DEADLINE_S = 5.0
MAX_CONNECTIONS = 64
MAX_CONNECTIONS_PER_IP = 16
SCRAPE_WORKERS = 2  # pool threads that render scrapes and probes

_LAT_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5, 2.0)


OTHER_NAMESPACES = "other"


class NamespaceLabels:
    """Namespace -> label value, for at most ``limit`` distinct namespaces (first seen
    first served); the rest share ``OTHER_NAMESPACES``. Thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._labels: dict[bytes, str] = {}
        self._lock = threading.Lock()

    def __call__(self, ns: bytes) -> str:
        label = self._labels.get(ns)
        if label is not None:
            return label
        with self._lock:
            label = self._labels.get(ns)
            if label is None:
                if len(self._labels) >= self.limit:
                    return OTHER_NAMESPACES
                # '' is the default namespace; a real namespace named 'other' is suffixed
                label = ns.decode("utf-8", "replace") or "<default>"
                if label == OTHER_NAMESPACES:
                    label += "~"
                self._labels[ns] = label
        return label

    def labelled(self, name: str) -> str | None:
        """The label of the namespace decoded as ``name`` if it has its own (None: it is
        counted under ``other``, or was never seen)."""
        ns = name.encode("utf-8", "surrogateescape")
        return self._labels.get(ns)


class ServerMetrics:
    """The counters of one server, updated per frame by the service and the shm ops and
    per event by the tiers (``quota_event``); thread-safe, never blocking."""

    def __init__(self, max_namespaces: int = 64) -> None:
        self.registry = CollectorRegistry()
        add_process_metrics(self.registry, "server")
        self._children: dict[tuple, Any] = {}  # child(): labelled children, cached
        self.items = Counter("gcache_items_total", "Items served, by op and status",
                             ["op", "status"], registry=self.registry)
        self.bytes = Counter("gcache_bytes_total", "Payload bytes, by direction (in=put, out=get)",
                             ["direction"], registry=self.registry)
        # gcache_frames_total and gcache_frame_seconds: counted per connection thread
        self.frame_stats = FrameStats()
        self.registry.register(self.frame_stats)
        self.read_throughs = Counter(
            "gcache_handoff_reads_total", "Items clients asked this server as their key's "
            "previous owner after a miss at the new owner (handoff reads, \"ho\": 1; GET, "
            "LEASE and EXISTS), by result (hit, miss)", ["result"], registry=self.registry)
        self.protocol_errors = Counter("gcache_protocol_errors_total",
                                       "Malformed frames / failed auth, by reason", ["reason"],
                                       registry=self.registry)
        self.refused = Counter("gcache_connections_refused_total",
                               "Connections closed at accept, or before AUTH to admit a newer "
                               "one, by reason (max_connections, preauth_per_ip, "
                               "preauth_total)", ["reason"], registry=self.registry)
        self.deadline_closed = Counter("gcache_deadline_closed_total",
                                       "Connections shut down past a deadline, by phase "
                                       "(handshake, request, send)", ["phase"], registry=self.registry)
        self.preauth = Gauge("gcache_preauth_connections",
                             "Connections accepted and not yet authenticated",
                             registry=self.registry)
        self.auth_refused = Counter("gcache_auth_refused_total",
                                    "Requests refused for lack of a right on their namespace "
                                    "(status AUTH), by credential id and op",
                                    ["credential", "op"], registry=self.registry)
        self.namespace = NamespaceLabels(max_namespaces)
        self.ns_hits = Counter("gcache_namespace_hits_total", "Items read (GET/LEASE) and "
                               "found, by namespace", ["namespace"], registry=self.registry)
        self.ns_misses = Counter("gcache_namespace_misses_total", "Items read (GET/LEASE) "
                                 "and not served, by namespace", ["namespace"],
                                 registry=self.registry)
        self.ns_bytes = Counter("gcache_namespace_bytes_total", "Payload bytes by namespace "
                                "and direction (in=put, out=get)", ["namespace", "direction"],
                                registry=self.registry)
        self.ns_quota_refused = Counter("gcache_namespace_quota_refused_total",
                                        "Puts refused at the namespace's memory quota",
                                        ["namespace"], registry=self.registry)
        self.ns_quota_evictions = Counter("gcache_namespace_quota_evictions_total",
                                          "Objects evicted (memory) or records killed or "
                                          "dropped (disk) to keep the namespace within its "
                                          "quota", ["namespace", "tier"],
                                          registry=self.registry)

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: the hot paths count per frame, and a
        ``labels`` call (a lock, label checks) cost about as much as a frame's per-item
        work for small frames. Label sets are bounded (ops, statuses, namespace labels)."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def add(self, counter: Any, *labels: str) -> Callable[[float], None]:
        """The per-frame form of ``child(counter, *labels).inc``: a cached function of
        one argument (the amount, >= 0) that adds to that labelled child. A Counter
        child's ``inc`` spends three Python calls checking that a labelled child is
        labelled before its one locked add; on a single-key frame (three or six adds)
        that was a third of the server's Python calls. This goes to the child's value
        (prometheus_client's ``_value.inc``, the same lock and float) when it has one,
        else to ``inc``."""
        key = (id(counter), labels, "add")
        fn = self._children.get(key)
        if fn is None:
            c = self.child(counter, *labels)
            value = getattr(c, "_value", None)
            fn = value.inc if callable(getattr(value, "inc", None)) else c.inc
            self._children[key] = fn
        return fn

    def quota_event(self, event: str, ns: bytes, n: int) -> None:
        """A tier's quota event (``refused``, ``evicted``, ``disk_evicted``); must not block
        (runs under the tier's lock)."""
        label = self.namespace(ns)
        if event == "refused":
            self.ns_quota_refused.labels(label).inc(n)
        else:
            self.ns_quota_evictions.labels(label, "disk" if event == "disk_evicted"
                                           else "memory").inc(n)

    def handoff_reads(self, meta: dict, hits: int, misses: int) -> None:
        """One read frame's items, when it is a handoff read (``"ho": 1``)."""
        if meta.get("ho") == 1:
            if hits:
                self.add(self.read_throughs, "hit")(hits)
            if misses:
                self.add(self.read_throughs, "miss")(misses)

    def namespace_reads(self, ns: bytes, hits: int, misses: int, nbytes: int) -> None:
        """One frame's reads of namespace ``ns`` (GET or LEASE)."""
        label = self.namespace(ns)
        if hits:
            self.add(self.ns_hits, label)(hits)
        if misses:
            self.add(self.ns_misses, label)(misses)
        if nbytes:
            self.add(self.ns_bytes, label, "out")(nbytes)

    def namespace_writes(self, ns: bytes, nbytes: int) -> None:
        """Payload bytes one frame put into namespace ``ns`` (PUT or COMMIT)."""
        if nbytes:
            self.add(self.ns_bytes, self.namespace(ns), "in")(nbytes)


class FrameRecorder:
    """One connection's frames and their service times, by op: plain lists and floats
    only its own thread writes (no lock, no labelled child per frame). ``FrameStats``
    reads them at scrape time."""

    __slots__ = ("bounds", "counts", "sums")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts: dict[str, list[int]] = {}  # op -> frames per bucket (not cumulative)
        self.sums: dict[str, float] = {}  # op -> seconds

    def record(self, op: str, seconds: float) -> None:
        """One frame of ``op`` that took ``seconds``; on the recorder's thread only."""
        c = self.counts.get(op)
        if c is None:
            self.sums[op] = 0.0  # before the counts: a reader that sees them sees this
            c = self.counts[op] = [0] * (len(self.bounds) + 1)
        c[bisect_left(self.bounds, seconds)] += 1  # the first bound >= seconds (le)
        self.sums[op] += seconds

    def snapshot(self) -> list[tuple[str, list[int], float]]:
        """``(op, counts, seconds)`` as of now, from any thread (each copy is one C-level
        operation under the GIL, so a reader never sees a list being resized)."""
        return [(op, list(c), self.sums[op]) for op, c in list(self.counts.items())]


class FrameStats:
    """``gcache_frames_total{op}`` and the histogram ``gcache_frame_seconds{op}``: each
    connection thread counts into its own ``FrameRecorder`` and a scrape sums the live
    recorders and what closed connections left (``retire``). prometheus_client's
    ``Histogram.observe`` added to every bucket at or above the value, each under a
    lock, and the frame counter took another: ~3.5 us per frame, a tenth of a one-key
    frame's Python. A scrape may miss the frames a connection records while it sums,
    never count one twice; a bucket's count never goes down."""

    def __init__(self, bounds: tuple[float, ...] = _LAT_BUCKETS) -> None:
        self.bounds = bounds
        self._lock = threading.Lock()
        self._live: set[FrameRecorder] = set()
        self._gone: dict[str, tuple[list[int], float]] = {}

    def recorder(self) -> FrameRecorder:
        r = FrameRecorder(self.bounds)
        with self._lock:
            self._live.add(r)
        return r

    def retire(self, r: FrameRecorder) -> None:
        """Fold a recorder whose thread records no more into the totals."""
        with self._lock:
            if r in self._live:
                self._live.discard(r)
                self._add(self._gone, r.snapshot())

    @staticmethod
    def _add(into: dict[str, tuple[list[int], float]],
             snap: list[tuple[str, list[int], float]]) -> None:
        for op, counts, seconds in snap:
            have = into.get(op)
            into[op] = ((counts, seconds) if have is None else
                        ([a + b for a, b in zip(have[0], counts)], have[1] + seconds))

    def totals(self) -> dict[str, tuple[list[int], float]]:
        """Per op: frames per bucket (not cumulative; the last is past every bound) and
        their seconds, over every connection this server served."""
        with self._lock:
            out = dict(self._gone)
            live = list(self._live)
        for r in live:
            self._add(out, r.snapshot())
        return out

    def collect(self):
        frames = CounterMetricFamily("gcache_frames", "Frames handled, by op", labels=["op"])
        hist = HistogramMetricFamily("gcache_frame_seconds", "Frame service time, by op",
                                     labels=["op"])
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for op, (counts, seconds) in sorted(self.totals().items()):
            cum = list(itertools.accumulate(counts))
            frames.add_metric([op], cum[-1])
            hist.add_metric([op], list(zip(les, cum)), seconds)
        yield frames
        yield hist


class _NamespaceCollector:
    """Per-namespace used bytes and quotas, read at scrape time, summed per label."""

    def __init__(self, usage_fn: Callable[[], dict], quotas: Any,
                 labels: NamespaceLabels) -> None:
        self.usage_fn, self.quotas, self.labels = usage_fn, quotas, labels

    def collect(self):
        used: dict[tuple[str, str], int] = {}
        quota: dict[tuple[str, str], int] = {}
        for ns, (mem, disk) in self.usage_fn().items():
            label = self.labels(ns)
            for tier, n in (("memory", mem), ("disk", disk)):
                used[(label, tier)] = used.get((label, tier), 0) + n
            if self.quotas is not None and label != OTHER_NAMESPACES:
                lim = self.quotas.limits(ns)
                for tier, q in (("memory", lim.memory_bytes), ("disk", lim.disk_bytes)):
                    if q is not None:
                        quota[(label, tier)] = q
        g = GaugeMetricFamily("gcache_namespace_used_bytes", "Bytes a namespace holds, by "
                              "tier (memory: slab chunks incl. reservations; disk: records)",
                              labels=["namespace", "tier"])
        for (label, tier), n in sorted(used.items()):
            g.add_metric([label, tier], n)
        yield g
        g = GaugeMetricFamily("gcache_namespace_quota_bytes", "A namespace's quota, by tier "
                              "(namespaces with a limit only)", labels=["namespace", "tier"])
        for (label, tier), n in sorted(quota.items()):
            g.add_metric([label, tier], n)
        yield g


class _TierCollector:
    _GAUGES = ("capacity_bytes", "used_bytes", "objects", "pending_puts", "free_pages",
               "largest_free_bytes", "connections")
    _COUNTERS = ("evictions", "evicted_bytes", "corrupt_dropped", "torn_dropped",
                 "pending_expired", "no_space", "clean_dropped", "quota_refused",
                 "quota_evictions", "put_if_absent_skipped")
    _DISK_GAUGES = ("capacity_bytes", "used_bytes", "allocated_bytes", "objects", "segments",
                    "degraded", "direct_io")
    _DISK_COUNTERS = ("hits", "read_bytes", "written_bytes", "corrupt_dropped", "read_errors",
                      "write_errors", "evictions", "carried_over", "compactions",
                      "dead_unpersisted", "quota_evictions")
    _MOVES = (("demoted", "objects demoted memory -> disk"),
              ("demoted_bytes", "bytes demoted memory -> disk"),
              ("promoted", "objects promoted disk -> memory"),
              ("promoted_bytes", "bytes promoted disk -> memory"),
              ("promote_skipped", "promotions skipped (no free memory, or changed meanwhile)"))

    _HANDOFF_COUNTERS = (("objects_moved", "objects the handoff worker put to their owners"),
                         ("bytes_moved", "bytes the handoff worker put to their owners"),
                         ("lost", "objects dropped in a handoff (their bytes failed the "
                          "checksum)"),
                         ("passes", "handoff passes finished"))
    _HANDOFF_GAUGES = (("objects_left", "objects the current handoff pass has still to move"),
                       ("bytes_left", "bytes the current handoff pass has still to move"),
                       ("waiting", "objects kept for the next pass (a put failed, or "
                        "no owner)"),
                       ("active", "1 while a handoff pass runs"))

    def __init__(self, stats_fn: Callable[[], dict], namespace: NamespaceLabels) -> None:
        self.stats_fn = stats_fn
        self.namespace = namespace  # the per-namespace label bound (the curve follows it)

    def collect(self):
        s = self.stats_fn()
        yield from self._handoff(s)
        yield from self._mrc(s.get("mrc"))
        for name in self._GAUGES:
            if name in s:
                g = GaugeMetricFamily(f"gcache_memory_{name}", f"memory tier {name}")
                g.add_metric([], s[name])
                yield g
        for name in self._COUNTERS:
            if name in s:
                c = CounterMetricFamily(f"gcache_memory_{name}", f"memory tier {name}")
                c.add_metric([], s[name])
                yield c
        for name, text in (("shm_leases", "read leases held by shm/nixl clients"),
                           ("shm_slots", "uncommitted put slots held by shm/nixl clients"),
                           ("nixl", "1 when the arena is registered with a NIXL agent")):
            if name in s:
                g = GaugeMetricFamily(f"gcache_{name}", text)
                g.add_metric([], s[name])
                yield g
        for name, text in (("stale_dropped", "objects of mutable namespaces dropped because "
                            "another server may have owned their key meanwhile (restart "
                            "after a membership change, a range that came back)"),
                           ("put_if_absent_tombstoned", "if-absent (handoff) put items "
                            "skipped because their key was deleted here recently")):
            if name in s:
                c = CounterMetricFamily(f"gcache_{name}", text)
                c.add_metric([], s[name])
                yield c
        if "tombstones" in s:
            g = GaugeMetricFamily("gcache_tombstones", "recently deleted keys remembered "
                                  "against if-absent puts")
            g.add_metric([], s["tombstones"])
            yield g
        g = GaugeMetricFamily("gcache_recovered_objects", "objects recovered at start")
        g.add_metric([], s.get("recovered", 0))
        yield g
        if "disk_capacity_bytes" not in s:
            return
        for name in self._DISK_GAUGES:
            g = GaugeMetricFamily(f"gcache_disk_{name}", f"disk tier {name}")
            g.add_metric([], s.get(f"disk_{name}", 0))
            yield g
        for name in self._DISK_COUNTERS:
            c = CounterMetricFamily(f"gcache_disk_{name}", f"disk tier {name}")
            c.add_metric([], s.get(f"disk_{name}", 0))
            yield c
        for name, text in self._MOVES:
            c = CounterMetricFamily(f"gcache_tier_{name}", text)
            c.add_metric([], s.get(name, 0))
            yield c
        for what in ("capacity_bytes", "used_bytes"):
            g = GaugeMetricFamily(f"gcache_tier_{what}", f"{what} per tier", labels=["tier"])
            g.add_metric(["memory"], s.get(what, 0))
            g.add_metric(["disk"], s.get(f"disk_{what}", 0))
            yield g

    def _mrc(self, doc: dict | None):
        """The miss-ratio curve (``server.mrc``): estimated hit ratios per namespace and
        capacity factor, for ``*`` and the namespaces with a label of their own (the same
        bounded set as every per-namespace series: ratios of the rest cannot be summed
        under ``other``)."""
        if not doc:
            return
        factors = [f"{f:g}" for f in doc["factors"]]
        hit = GaugeMetricFamily("gcache_mrc_hit_ratio", "estimated memory hit ratio of GETs "
                                "if memory were capacity_factor times its size (namespace "
                                "'*': all)", labels=["namespace", "capacity_factor"])
        byte_hit = GaugeMetricFamily("gcache_mrc_byte_hit_ratio", "estimated memory hit "
                                     "ratio of GET bytes if memory were capacity_factor "
                                     "times its size", labels=["namespace", "capacity_factor"])
        actual = GaugeMetricFamily("gcache_mrc_actual_hit_ratio", "memory hit ratio of the "
                                   "GETs the curve sampled (compare with capacity_factor 1)",
                                   labels=["namespace"])
        gets = GaugeMetricFamily("gcache_mrc_gets", "reads (GETs, and EXISTS that decide "
                                 "them) the curve's estimate stands for (sampled, scaled by "
                                 "the sample rate)", labels=["namespace"])
        for name, d in doc["namespaces"].items():
            ns = name if name == "*" else self.namespace.labelled(name)
            if ns is None:
                continue
            for f, h, b in zip(factors, d["hit_ratio"], d["byte_hit_ratio"]):
                hit.add_metric([ns, f], h)
                byte_hit.add_metric([ns, f], b)
            actual.add_metric([ns], d["actual_hit_ratio"])
            gets.add_metric([ns], d["gets"])
        yield from (hit, byte_hit, actual, gets)
        for name, text in (("sample_rate", "fraction of keys the curve tracks"),
                           ("tracked_keys", "keys in the curve's ghost cache")):
            g = GaugeMetricFamily(f"gcache_mrc_{name}", text)
            g.add_metric([], doc[name])
            yield g

    def _handoff(self, s: dict):
        if "self_drain" in s:
            g = GaugeMetricFamily("gcache_self_drain", "1 for the reason this server drained "
                                  "itself (stop, unhealthy_file, disk_degraded)",
                                  labels=["reason"])
            for reason in DrainReason:
                g.add_metric([reason.value], int(s["self_drain"] == reason.value))
            yield g
        if "handoff_passes" not in s:
            return
        for name, text in self._HANDOFF_COUNTERS:
            c = CounterMetricFamily(f"gcache_handoff_{name}", text)
            c.add_metric([], s.get(f"handoff_{name}", 0))
            yield c
        for name, text in self._HANDOFF_GAUGES:
            g = GaugeMetricFamily(f"gcache_handoff_{name}", text)
            g.add_metric([], s.get(f"handoff_{name}", 0))
            yield g


class _PhaseCollector:
    """``gcache_server_phase{phase}``: 1 for the phase the server is in, 0 for the others;
    ``gcache_server_phase_progress``: how far the current phase got (prefault, recovery)."""

    def __init__(self, phase_fn: Callable[[], tuple[Any, float]]) -> None:
        self.phase_fn = phase_fn

    def collect(self):
        now, frac = self.phase_fn()
        g = GaugeMetricFamily("gcache_server_phase", "1 for the server's current phase "
                              "(binding, prefault, recovery, starting, serving, stopping)",
                              labels=["phase"])
        for p in Phase:
            g.add_metric([p.value], 1.0 if p is now else 0.0)
        yield g
        pg = GaugeMetricFamily("gcache_server_phase_progress",
                               "fraction done of the current phase (prefault, recovery)")
        pg.add_metric([], frac)
        yield pg


class MetricsEndpoint:
    """/metrics and /healthz of one server on ``listen``; https when ``tls`` (the data
    port's context, so mTLS applies to scrapers too) is given.

    ``metrics``: the counters; ``stats_fn``: the server's stats dict (tier gauges and
    counters, read at scrape time); ``usage_fn``: ``{ns: (memory bytes, disk bytes)}``
    (the tier's ``namespace_usage``); ``quotas``: a ``gcache.quotas.QuotaStore``;
    ``health_fn``: the /healthz document; ``ready_fn``: ``(ready, why)`` for /readyz (200
    or 503); ``phase_fn``: ``(phase, progress)`` for the phase gauges. The port is bound
    here (OSError if it cannot be); ``start`` serves, ``stop`` shuts down and closes the
    port (idempotent)."""

    def __init__(self, listen: str, metrics: ServerMetrics, *, stats_fn: Callable[[], dict],
                 usage_fn: Callable[[], dict], quotas: Any, health_fn: Callable[[], dict],
                 ready_fn: Callable[[], tuple[bool, str]] | None = None,
                 phase_fn: Callable[[], tuple[Any, float]] | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        # read at scrape time, after the counters (the order the scrape has always had)
        collectors = CollectorRegistry()
        collectors.register(_TierCollector(stats_fn, metrics.namespace))
        collectors.register(_NamespaceCollector(usage_fn, quotas, metrics.namespace))
        if phase_fn is not None:
            collectors.register(_PhaseCollector(phase_fn))
        self._registries = (metrics.registry, collectors)
        self._health_fn, self._ready_fn = health_fn, ready_fn
        # aiohttp (about 12 MiB of RSS) only in servers that serve metrics
        from gcache.bounded_aiohttp import BoundedAioServer

        host, port = listen.rsplit(":", 1)
        self.http = BoundedAioServer((host.strip("[]"), int(port)), self._serve,
                                     max_connections=MAX_CONNECTIONS,
                                     max_per_ip=MAX_CONNECTIONS_PER_IP, tls=tls,
                                     request_deadline_s=REQUEST_DEADLINE_S,
                                     blocking_workers=SCRAPE_WORKERS, flags=None,
                                     name="gcache-server's metrics endpoint")
        self._started = False
        self._lock = threading.Lock()
        self._closed = False

    @property
    def scheme(self) -> str:
        return "https" if self.http.tls is not None else "http"

    @property
    def address(self) -> tuple[str, int]:
        """The bound ``(host, port)`` (the kernel's choice when ``listen`` gave port 0)."""
        return self.http.server_address[0], self.http.server_address[1]

    def _answer(self, path: str) -> tuple[int, bytes, str]:
        """``(status, body, content type)`` for a GET of ``path`` (a pool thread)."""
        if path == "/metrics":
            return (200, b"".join(generate_latest(r) for r in self._registries),
                    "text/plain; version=0.0.4")
        if path == "/healthz":
            return 200, json.dumps(self._health_fn()).encode(), "application/json"
        if path == "/readyz" and self._ready_fn is not None:
            ready, why = self._ready_fn()
            return (200 if ready else 503, json.dumps({"ready": ready, "reason": why}).encode(),
                    "application/json")
        return (404, json.dumps({"error": f"no {path}: try /metrics, /healthz or /readyz"})
                .encode(), "application/json")

    async def _serve(self, request: web.BaseRequest) -> web.StreamResponse:
        from aiohttp import web  # loaded already: BoundedAioServer serves this

        if request.method != "GET":
            code, body, ctype = 405, b'{"error": "only GET is served here"}', "application/json"
        else:
            code, body, ctype = await self.http.run_blocking(self._answer, request.path)
        resp = web.Response(status=code, body=body, headers={"Content-Type": ctype})
        if code >= 400 and code != 503:
            resp.force_close()
        return resp

    def start(self) -> None:
        with self._lock:
            if self._started or self._closed:
                return
            self._started = True
            self.http.start("gcache-http")

    def stop(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.http.stop()

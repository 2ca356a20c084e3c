"""Prometheus metrics and the HTTP endpoint (/metrics, /healthz) of one server.

Counters are updated per frame (not per key) on the hot path; tier gauges and
counters are read from the tier's ``stats()`` at scrape time (the same dict the
STATS reply and the master heartbeat carry): ``gcache_memory_*`` for the
memory tier, ``gcache_disk_*`` for the NVMe tier, ``gcache_tier_*`` for
movement between them, and ``gcache_tier_{capacity,used}_bytes{tier=...}``
side by side.
"""

from __future__ import annotations

import http.server
import json
import ssl
import threading
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, CounterMetricFamily

from gcache.tls import HTTPServer

_LAT_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5, 2.0)


class ServerMetrics:
    def __init__(self, stats_fn: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        self.items = Counter("gcache_items_total", "Items served, by op and status",
                             ["op", "status"], registry=self.registry)
        self.bytes = Counter("gcache_bytes_total", "Payload bytes, by direction (in=put, out=get)",
                             ["direction"], registry=self.registry)
        self.frames = Counter("gcache_frames_total", "Frames handled, by op", ["op"],
                              registry=self.registry)
        self.protocol_errors = Counter("gcache_protocol_errors_total",
                                       "Malformed frames / failed auth, by reason", ["reason"],
                                       registry=self.registry)
        self.latency = Histogram("gcache_frame_seconds", "Frame service time, by op", ["op"],
                                 buckets=_LAT_BUCKETS, registry=self.registry)
        self.registry.register(_TierCollector(stats_fn))


class _TierCollector:
    _GAUGES = ("capacity_bytes", "used_bytes", "objects", "pending_puts", "free_pages",
               "connections")
    _COUNTERS = ("evictions", "evicted_bytes", "corrupt_dropped", "torn_dropped",
                 "pending_expired", "no_space", "clean_dropped")
    _DISK_GAUGES = ("capacity_bytes", "used_bytes", "allocated_bytes", "objects", "segments",
                    "degraded", "direct_io")
    _DISK_COUNTERS = ("hits", "read_bytes", "written_bytes", "corrupt_dropped", "read_errors",
                      "write_errors", "evictions", "carried_over", "compactions",
                      "dead_unpersisted")
    _MOVES = (("demoted", "objects demoted memory -> disk"),
              ("demoted_bytes", "bytes demoted memory -> disk"),
              ("promoted", "objects promoted disk -> memory"),
              ("promoted_bytes", "bytes promoted disk -> memory"),
              ("promote_skipped", "promotions skipped (no free memory, or changed meanwhile)"))

    def __init__(self, stats_fn: Callable[[], dict]) -> None:
        self.stats_fn = stats_fn

    def collect(self):
        s = self.stats_fn()
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


def serve_http(listen: str, metrics: ServerMetrics, health_fn: Callable[[], dict],
               tls: ssl.SSLContext | None = None) -> HTTPServer:
    """Serve /metrics and /healthz on ``listen``; https when ``tls`` (the data port's
    context, so mTLS applies to scrapers too) is given."""
    host, port = listen.rsplit(":", 1)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/metrics":
                body, ctype = generate_latest(metrics.registry), "text/plain; version=0.0.4"
            elif self.path == "/healthz":
                body, ctype = json.dumps(health_fn()).encode(), "application/json"
            else:
                self.send_error(404, "try /metrics or /healthz")
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    srv = HTTPServer((host, int(port)), Handler, tls=tls)
    threading.Thread(target=srv.serve_forever, name="gcache-http", daemon=True).start()
    return srv

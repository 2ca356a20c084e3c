"""``Server``: one gcache-server, built from its config, with ``start()`` / ``stop()``.

The server is an object, not a script: it builds and owns every part, finished at
construction (no attribute of a part is assigned afterwards; what a part reads is
passed to its constructor), so a test can run two servers in one process.

What it owns, in the order the constructor builds it (a failure closes what was
already built, logs why and raises ``ServerStartError`` with what to fix):

 1. TLS contexts (``tls_contexts``: the data port's, also the metrics endpoint's; the
    dialer's for the masters). The CLI builds them first, so a bad certificate is a
    usage error before logging starts.
 2. ``credentials`` and ``quotas`` (their files are read here; SIGHUP re-reads them),
    and ``metrics``: the counters (``ServerMetrics``), which the endpoint, the tiers and
    the service update.
 3. The ports, before the arena exists, so a refusal or a busy port costs no prefault
    and leaves nothing (``_bind``): ``listener``, the data socket, bound and listening
    (the kernel's port when ``--listen`` asked for port 0), and ``metrics_endpoint``
    (``--metrics-listen`` only: /metrics, /healthz and /readyz), which serves from here
    on, so probes and the ``gcache_server_phase`` gauge answer while the arena prefaults;
    then, with ``--kv-events-endpoint``, the KV-event publisher's sockets (``kv_events``).
    ``startup`` (``startup.py``) holds the phase and logs the prefault's and the
    recovery's progress.
 4. ``arena``: the ``/dev/shm`` file, created or reused (restart survival).
 5. ``memory_tier``, and with ``--disk-dir`` the disk tier behind it: ``tier`` is the
    memory tier or the ``TieredStore`` over both.
 6. ``shm``: the shm registry (connection states, lease expiry, reaper);
    ``GCACHE_SHM_LEASE_MS`` is read here.
 7. ``nixl``: the arena registered with a NIXL agent (per ``--nixl``; off under TLS).
 8. ``freshness`` (``--masters`` only: the rule that drops or refuses objects of
    ``mutable_namespaces`` another server may have overwritten, ``freshness.py``; the
    last ring epoch persists in ``<shm_dir>/gcache-<name>.epoch``) and ``tombstones``
    (recent deletes an if-absent put must not undo, ``tombstones.py``).
    ``handoff``, ``agent`` and ``self_drain`` (``--masters`` only): the handoff worker
    (``handoff.py``: pushes what this server holds but no longer owns to the owners,
    through the SDK), the membership agent, told the advertised address, as its
    ``on_view`` the handoff's ``view_changed`` and as its ``reconcile`` the freshness
    rule's ``adopt``, and the self-drain (``self_drain.py``: the drain before a graceful
    stop, and the monitor that drains an unhealthy server).
 9. ``service``: accept loop, deadlines, connections; gets the listener, the agent (for
    NOT_OWNER checks), the freshness rule and the tombstones, the nixl registration and
    the shm registry.

A failure after the ports closes what was built and, on a first start (the arena file
did not exist), removes the arena file.

``start()`` starts, in order: the shm reaper, the agent (registers and heartbeats in
the background: serving never waits for the masters), the tiers' background threads,
the handoff worker, the self-drain monitor, and last the service's accept loop, so no
client is served before everything behind it runs. ``stop(drain_s)`` with a budget
(``run`` passes ``--drain-on-stop``) first drains the server while everything still runs
(``SelfDrain.drain``) and, once nothing is left, removes it from the masters after its
heartbeats stopped; a stop without a drain marks the member down at the masters instead
(``_leave_down``, at most 1 s), so clients route around it at once, and a restart under
the same name comes back warm. ``stop()`` then undoes ``start``: signals the handoff
worker (its SDK clients closed, so a put in flight ends) and the agent, stops the service
(listening socket closed, connections shut down and released), the metrics endpoint
(port closed) and the reaper, joins the handoff worker (it holds pins on the tier) and
the agent, closes nixl (explicitly: an agent left to interpreter exit can crash it),
then closes the tier clean: the arena is marked clean and the disk index written. The
arena *file* stays, by design (a restart under the same name finds every acknowledged
object), unless ``--remove-arena-on-exit``.

Threads:
 * ``__init__``, ``start``, ``stop``: the owner's thread. ``start`` and ``stop`` are
   idempotent and serialised; ``stop`` works whether or not ``start`` ran, and is
   bounded (the service about 5 s, the metrics endpoint and the reaper one tick, the
   handoff worker 5 s, the agent 3 s, the deregistration 3 s) after the drain's budget,
   except that closing the disk tier writes its index, which takes time in proportion to
   it. A stopped server cannot be started again: build a new one.
 * ``run``: the main thread only (it installs the SIGTERM / SIGINT / SIGHUP handlers);
   blocks until SIGTERM or SIGINT, then stops (draining first for ``--drain-on-stop``;
   a second SIGTERM or SIGINT ends the drain at once).
 * ``stats``, ``health``: any thread (scrapes, heartbeats, tests); never block.
 * ``reload``: the owner's thread (``run`` calls it on SIGHUP, outside the handler).

Process-wide settings are not the server's: logging and failpoints are set up by the
CLI (``gcache.server.cli``) before it builds the server.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import ssl
import sys
import threading
import time
from typing import Any, Iterator, NamedTuple

from gcache.config import Config
from gcache.credentials import CredentialStore
from gcache.errors import (ArenaError, ConfigError, DiskError, MasterError,
                           MasterUnavailable, ServerStartError)
from gcache.network import check_bind
from gcache.protocol import Limits
from gcache.namespace_kinds import NamespaceKinds
from gcache.quotas import QuotaStore
from gcache.server import nixl_ops
from gcache.signals import relay_signals
from gcache.view import MemberState
from gcache.server.agent import MembershipAgent
from gcache.server.arena import Arena, arena_path, header_len
from gcache.server.eviction import make_policy
from gcache.kv_events import Medium, check_kv_events
from gcache.server.kv_events import EventQueue, Resident
from gcache.server.mrc import MissRatioCurve
from gcache.server.freshness import EpochFile, Freshness
from gcache.server.handoff import PUT_TIMEOUT_MS, Handoff
from gcache.server.memory_tier import MemoryTier
from gcache.server.metrics import MetricsEndpoint, ServerMetrics
from gcache.server.recent import RecentRates
from gcache.server.self_drain import SelfDrain
from gcache.server.shm_ops import ShmRegistry
from gcache.server.tombstones import Tombstones
from gcache.server.service import Listener, Service, listen_on
from gcache.server.startup import Phase, Startup
from gcache.tls import dialer_context, listener_context

log = logging.getLogger("gcache.server")


class ServerTLS(NamedTuple):
    """The server's TLS contexts; None where TLS is off."""

    listener: ssl.SSLContext | None  # the data port and the metrics endpoint
    dialer: ssl.SSLContext | None  # https to the masters


def tls_contexts(cfg: Config) -> ServerTLS:
    """The TLS contexts of a server config; ConfigError for bad certificate files, or for
    ``--nixl on`` with TLS."""
    tls = listener_context(cfg)
    masters_tls = dialer_context(cfg)
    if tls is not None and cfg.nixl == "on":
        raise ConfigError("--nixl on with TLS: nixl moves bytes by RDMA outside the TLS "
                          "channel, and TLS clients never use it; use --nixl off (or "
                          "auto, which is off under TLS)")
    return ServerTLS(tls, masters_tls)


def build_limits(cfg: Config) -> Limits:
    """The wire limits: the configured ones, with values capped at one slab page."""
    biggest = cfg.slab_bytes - header_len(cfg.max_namespace_bytes, cfg.max_key_bytes)
    return Limits(max_key_bytes=cfg.max_key_bytes, max_namespace_bytes=cfg.max_namespace_bytes,
                  max_value_bytes=min(cfg.max_value_bytes, biggest),
                  max_batch_items=cfg.max_batch_items, max_header_bytes=cfg.max_header_bytes,
                  max_frame_bytes=cfg.max_frame_bytes)


_MRC_TOP_NAMESPACES = 8  # namespaces of the curve carried by heartbeats and STATS


def _refused(message: str, log_format: str, *args: Any) -> ServerStartError:
    """Log why the server cannot start; the error to raise (its message for the user)."""
    log.error(log_format, *args)
    return ServerStartError(message)


class Server:
    """One gcache-server; see the module docstring for what it owns and the threads."""

    def __init__(self, cfg: Config, tls: ServerTLS | None = None) -> None:
        """Build every part (nothing runs until ``start``). ``tls``: the contexts from
        ``tls_contexts(cfg)`` (built here when not given). Raises ConfigError (TLS) and
        ServerStartError."""
        self.cfg = cfg
        self.tls = tls_contexts(cfg) if tls is None else tls
        try:
            self.credentials = CredentialStore(cfg.credentials_file, cfg.token)
            self.quotas = QuotaStore(cfg.quota_file)
        except ConfigError as exc:
            raise _refused(str(exc), "%s", exc) from None
        self.metrics = ServerMetrics(cfg.metrics_max_namespaces)
        self.recent = RecentRates(self.metrics.registry)  # ops/s, hit ratio, p99 lately
        self.startup = Startup()  # the phase: the log, /readyz and a gauge
        self._built = False  # every part behind the ports exists (stats can read them)
        self._new_disk_root: str | None = None  # the disk tier's directory, if this start made it
        self._life = threading.Lock()  # serialises start and stop
        self._started = self._stopped = False
        # Every port before the arena: a busy port costs no prefault and leaves nothing.
        self.listener, self.metrics_endpoint = self._bind(cfg)
        self.kv_events: Any = None
        try:
            # KV events (--kv-events-endpoint): one queue per tier, filled under its lock;
            # the publisher's sockets are ports too, bound before the arena
            self.kv_queues = ([EventQueue(Medium.MEMORY, cfg.kv_events_queue_events)]
                              + ([EventQueue(Medium.DISK, cfg.kv_events_queue_events)]
                                 if cfg.disk_dir else [])
                              if cfg.kv_events_endpoint else [])
            self.kv_events = self._kv_event_publisher()
            self._build(cfg)
        except BaseException:  # close what was built; a first start leaves no arena file
            self.listener.sock.close()
            if self.metrics_endpoint is not None:
                self.metrics_endpoint.stop()
            if self.kv_events is not None:
                self.kv_events.stop()
            arena = getattr(self, "arena", None)
            if arena is not None and arena.created:
                for path in (self.arena_path, epoch_path(self.arena_path)):
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
                if self._new_disk_root is not None:  # made by this start: nothing in it
                    shutil.rmtree(self._new_disk_root, ignore_errors=True)
            raise
        self._built = True

    def _bind(self, cfg: Config) -> tuple[Listener, MetricsEndpoint | None]:
        """Bind the data port and the metrics port (serving at once: probes and the
        start-up phase gauge answer while the arena prefaults); a refusal or a busy port
        raises ServerStartError naming the flag, and leaves nothing bound."""
        try:
            check_bind(cfg.listen, self.credentials.required)
            if cfg.metrics_listen:  # /metrics and /healthz describe the server to any reader
                check_bind(cfg.metrics_listen, self.credentials.required, "--metrics-listen")
            check_kv_events(cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint,
                            self.credentials.required)  # it names keys to any subscriber
        except (ConfigError, ValueError) as exc:
            raise _refused(str(exc), "%s", exc) from None
        try:
            listener = listen_on(cfg.listen, self.credentials.required)
        except OSError as exc:
            raise _refused(f"cannot bind --listen {cfg.listen}: {exc.strerror or exc}",
                           "cannot bind --listen %s: %s", cfg.listen, exc) from None
        if not cfg.metrics_listen:
            return listener, None
        try:
            endpoint = MetricsEndpoint(cfg.metrics_listen, self.metrics, stats_fn=self.stats,
                                       usage_fn=self._usage, quotas=self.quotas,
                                       health_fn=self.health, ready_fn=self.readiness,
                                       phase_fn=self.startup.snapshot, tls=self.tls.listener)
        except OSError as exc:
            listener.sock.close()
            raise _refused(f"cannot bind --metrics-listen {cfg.metrics_listen}: "
                           f"{exc.strerror or exc}", "cannot bind --metrics-listen %s: %s",
                           cfg.metrics_listen, exc) from None
        endpoint.start()
        log.info("metrics on %s://%s:%d/metrics", endpoint.scheme, *endpoint.address)
        return listener, endpoint

    def _build(self, cfg: Config) -> None:
        """The arena, the tiers and every part behind the bound ports (the module
        docstring's list, from 4); a failure closes what it built and raises."""
        self.arena_path = arena_path(cfg.shm_dir, cfg.name)
        self.startup.enter(Phase.PREFAULT)
        try:
            self.arena = Arena(self.arena_path, cfg.memory_bytes, cfg.slab_bytes,
                               prefault=cfg.prefault, group=_group_id(cfg.shm_group),
                               progress=self.startup.progress("bytes"))
        except ArenaError as exc:
            raise _refused(str(exc), "cannot open arena: %s", exc) from None
        if self.arena.reused:
            log.info("reusing arena %s (%s; previous stop was %s)", self.arena_path,
                     self.arena.reuse_reason,
                     "clean" if self.arena.was_clean else "a crash: verifying every object")
        else:
            log.info("clean start of arena %s: %s", self.arena_path, self.arena.reuse_reason)
        try:
            self.mrc = (MissRatioCurve(self.arena.npages * self.arena.slab_bytes,
                                       tracked_keys=cfg.mrc_tracked_keys,
                                       sample_rate=cfg.mrc_sample_rate)
                        if cfg.mrc else None)
        except ConfigError as exc:  # a bad --mrc-tracked-keys: leave the arena as it was
            self.arena.close(self.arena.was_clean, self.arena.next_version)
            raise _refused(str(exc), "%s", exc) from None
        self.startup.enter(Phase.RECOVERY)
        self.memory_tier = MemoryTier(self.arena, high_watermark=cfg.high_watermark,
                                      low_watermark=cfg.low_watermark,
                                      pending_put_timeout_ms=cfg.pending_put_timeout_ms,
                                      quotas=self.quotas, on_quota=self.metrics.quota_event,
                                      eviction_policy=make_policy(cfg.eviction_policy),
                                      access_observer=self.mrc,
                                      recovery_progress=self.startup.progress("objects"),
                                      recency_snapshot_s=cfg.recency_snapshot_ms / 1000,
                                      events=self.kv_queues[0] if self.kv_queues else None)
        log.info("arena ready", extra={"fields": dict(self.memory_tier.recovery)})
        self.limits = build_limits(cfg)
        self.shm = ShmRegistry()  # GCACHE_SHM_LEASE_MS is read here
        if cfg.disk_dir:
            from gcache.server.disk import tier_root

            root = tier_root(cfg.disk_dir, cfg.name)
            self._new_disk_root = None if os.path.exists(root) else root
        # the server.tier.Tier contract, plus start() and capacity
        self.tier: Any = (_open_disk_tier(cfg, self.memory_tier, self.limits,
                                          self.kv_queues[1] if self.kv_queues else None)
                          if cfg.disk_dir else self.memory_tier)
        try:
            # under TLS nixl stays off: its bytes would bypass the TLS channel
            self.nixl = nixl_ops.start("off" if self.tls.listener is not None else cfg.nixl,
                                       self.arena, cfg.name, self.shm.lease_ms)
        except Exception as exc:  # NixlUnavailable, or the backend refused the registration
            self.tier.close(clean=True)
            raise _refused(f"cannot start the nixl transport (--nixl on): {exc}",
                           "cannot start the nixl transport: %s", exc) from None
        self.startup.enter(Phase.STARTING)
        try:
            advertise = self._advertise()
            # the freshness rule (mutable namespaces; with masters only) and the deletes an
            # if-absent put must not undo: kept for a handoff put's life (its deadline,
            # twice, and the request deadline of its frame)
            self.freshness = (
                Freshness(self.tier, NamespaceKinds(cfg.mutable_namespaces), cfg.name,
                          EpochFile(epoch_path(self.arena_path)),
                          self.memory_tier.next_version)
                if cfg.masters else None)
            self.tombstones = Tombstones(2 * PUT_TIMEOUT_MS / 1000
                                         + cfg.request_timeout_ms / 1000)
            self.handoff = (
                Handoff(self.tier, cfg.name, advertise, masters=cfg.masters,
                        credential=cfg.credential, token=cfg.token, tls=self.tls.dialer,
                        limits=self.limits, migrate_mbps=cfg.migrate_mbps,
                        on_join=cfg.handoff_on_join, grace_s=cfg.handoff_grace_ms / 1000.0)
                if cfg.masters else None)
            self.agent = self._agent(advertise)
            self.self_drain = (
                SelfDrain(self.agent, self.handoff, self.tier.stats,
                          unhealthy_file=cfg.unhealthy_file,
                          disk_degraded_after_s=cfg.auto_drain_after_ms / 1000.0
                          if cfg.disk_dir else 0.0)
                if self.agent is not None and self.handoff is not None else None)
            self.service = Service(
                self.tier, listener=self.listener, name=cfg.name, token=cfg.token,
                limits=self.limits, metrics=self.metrics, max_connections=cfg.max_connections,
                credentials=self.credentials,
                max_preauth_connections=cfg.max_preauth_connections,
                max_preauth_per_ip=cfg.max_preauth_per_ip,
                handshake_timeout_ms=cfg.handshake_timeout_ms,
                send_timeout_ms=cfg.send_timeout_ms, request_timeout_ms=cfg.request_timeout_ms,
                tls=self.tls.listener, quotas=self.quotas,
                shm_trusted_writers=cfg.shm_trusted_writers, shm=self.shm,
                ownership=self.agent, nixl_info=self.nixl.info if self.nixl else None,
                extra_stats=self._extra_stats, freshness=self.freshness,
                tombstones=self.tombstones)
        except BaseException:  # close what was built
            self._close_storage()
            raise

    def _kv_event_publisher(self) -> Any:
        """The KV-event publisher (``--kv-events-endpoint``), its sockets bound; None when
        off. ServerStartError when an endpoint cannot be bound."""
        cfg = self.cfg
        if not cfg.kv_events_endpoint:
            return None
        from gcache.server.kv_event_publisher import KvEventPublisher  # zmq: only when on
        import zmq

        try:
            return KvEventPublisher(cfg.name, self.kv_queues, cfg.kv_events_endpoint,
                                    replay_endpoint=cfg.kv_events_replay_endpoint,
                                    resident=self._resident,
                                    buffer_batches=cfg.kv_events_buffer_batches)
        except zmq.ZMQError as exc:
            raise _refused(f"cannot bind the KV-event endpoints {cfg.kv_events_endpoint} / "
                           f"{cfg.kv_events_replay_endpoint or '-'}: {exc}; pick a free "
                           "port", "cannot bind the KV-event endpoints: %s", exc) from None

    def _resident(self) -> Iterator[Resident]:
        """What the tiers hold now, per medium (a chunked walk: the KV-event snapshots)."""
        for h in self.memory_tier.held():
            yield Resident(h.ns, h.key, Medium.MEMORY)
        if self.tier is not self.memory_tier:
            for h in self.tier.disk.held():
                yield Resident(h.ns, h.key, Medium.DISK)

    def _advertise(self) -> str:
        """The address clients reach this server at (``--advertise``, else the bound
        listener with a wildcard host replaced by this host's name)."""
        advertise = self.cfg.advertise or self.listener.address
        if advertise.rsplit(":", 1)[0].strip("[]") in ("0.0.0.0", "::"):
            advertise = f"{socket.getfqdn()}:{advertise.rsplit(':', 1)[1]}"
        return advertise

    def _agent(self, advertise: str) -> MembershipAgent | None:
        """The membership agent when masters are configured (not started)."""
        cfg = self.cfg
        if not cfg.masters:
            return None
        # the masters take the server's credential (one with server = true), else the token
        # stats: read by heartbeats, which run only after start(), once the service exists
        return MembershipAgent(cfg.masters, cfg.credential or cfg.token, cfg.name, advertise,
                               self.tier.capacity, self.stats, cfg.heartbeat_interval_ms,
                               tls=self.tls.dialer,
                               on_view=self.handoff.view_changed if self.handoff else None,
                               reconcile=self.freshness.adopt if self.freshness else None)

    def _close_storage(self) -> None:
        if self.nixl is not None:
            self.nixl.close()  # explicit: a NIXL agent left to interpreter exit can crash it
        self.tier.close(clean=True)

    # ------------------------------------------------------------------ what tests read
    @property
    def address(self) -> str:
        """The data port, ``host:port`` (the bound port, also when ``--listen`` gave 0)."""
        return self.listener.address

    @property
    def metrics_address(self) -> str | None:
        """The metrics endpoint, ``host:port``; None without ``--metrics-listen``."""
        if self.metrics_endpoint is None:
            return None
        host, port = self.metrics_endpoint.address
        return f"{host}:{port}"

    def stats(self) -> dict:
        """The tier's stats with the connection count and the shm/nixl numbers (heartbeats,
        /metrics gauges, /healthz); empty while the server is still being built."""
        if not self._built:
            return {}
        s = self.tier.stats()
        s["connections"] = self.service.connections
        s.update(self.recent.sample())
        s.update(self.service.guard_stats())
        s.update(self.shm.stats(self.nixl is not None))
        s.update(self._extra_stats())
        return s

    def _extra_stats(self) -> dict:
        """The membership numbers and the miss-ratio curve (also in the wire STATS)."""
        s = self._membership_stats()
        if self.kv_events is not None:
            s.update(self.kv_events.stats())
        if self.mrc is not None:
            s["mrc"] = self.mrc.snapshot(top=_MRC_TOP_NAMESPACES)
        return s

    def _membership_stats(self) -> dict:
        """The handoff's and the self-drain's numbers (also in the wire STATS)."""
        s: dict = {}
        if self.handoff is not None:
            s.update(self.handoff.stats())
        if self.self_drain is not None:
            s.update(self.self_drain.stats())
        return s

    def _usage(self) -> dict:
        """``{ns: (memory bytes, disk bytes)}`` for the metrics; empty while building."""
        return self.tier.namespace_usage() if self._built else {}

    def health(self) -> dict:
        """The /healthz document (liveness: the process answers; it says its phase)."""
        return {"status": "ok", "name": self.cfg.name, "phase": self.startup.snapshot()[0].value,
                **self.stats()}

    def readiness(self) -> tuple[bool, str]:
        """``(ready to serve, why not)`` for /readyz: not while it binds, prefaults,
        recovers or starts, while it is not registered with its masters, while it drains
        (asked to, or by itself) or stops."""
        phase = self.startup.snapshot()[0]
        if phase is not Phase.SERVING:
            return False, self.startup.describe()
        if self.agent is not None:
            if not self.agent.registered.is_set():
                return False, "not registered with the masters"
            if self.agent.state == MemberState.DRAINING:
                reason = self.self_drain.stats()["self_drain"] if self.self_drain else ""
                return False, f"draining ({reason})" if reason else "draining"
        return True, "serving"

    def reload(self) -> None:
        """Re-read the credentials and quotas files (a bad file keeps the old ones and logs
        why); connections apply the new grants from their next frame."""
        self.credentials.reload()
        self.quotas.reload()

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        """Start every background part, the accept loop last (see the module docstring)."""
        with self._life:
            if self._started or self._stopped:
                return
            self._started = True
            try:
                self.shm.start()
                if self.agent is not None:
                    self.agent.start()  # in the background: serving never waits for masters
                if self.kv_events is not None:  # before the tiers move anything
                    self.kv_events.start()
                    log.info("KV events on %s (replay %s)", self.kv_events.endpoint,
                             self.kv_events.replay_endpoint or "off")
                self.tier.start()
                if self.handoff is not None:
                    self.handoff.start()
                if self.self_drain is not None:
                    self.self_drain.start()
                self.service.start()
            except BaseException:
                self._do_stop()
                raise
            self.startup.enter(Phase.SERVING)
        cfg = self.cfg
        log.info("serving", extra={"fields": {
            "listen": self.address, "name": cfg.name,
            "tls": "mtls" if cfg.tls_require_client_cert
            else "on" if self.tls.listener is not None else "off"}})

    def stop(self, drain_s: float = 0.0, abort: threading.Event | None = None) -> None:
        """Stop serving and close everything, the tier clean (see the module docstring);
        idempotent, bounded. ``drain_s`` > 0 (a server with masters, started): first drain
        it for at most that long (less once ``abort`` is set), serving meanwhile, and
        deregister it when nothing is left."""
        with self._life:
            drained = False
            if (drain_s > 0 and self.self_drain is not None and self._started
                    and not self._stopped):
                try:
                    drained = self.self_drain.drain(drain_s, abort or threading.Event()).done
                except Exception:  # a bug must not keep the server from stopping
                    log.exception("the drain before the stop failed; stopping")
            elif drain_s > 0 and not self._stopped:
                log.warning("--drain-on-stop: this server has no masters to drain it "
                            "through; stopping at once")
            self._do_stop(deregister=drained)

    def _do_stop(self, deregister: bool = False) -> None:
        """``stop`` with ``_life`` held; ``deregister``: remove the member from the masters
        once its heartbeats stopped (a full drain is done)."""
        if self._stopped:
            return
        self._stopped = True
        self.startup.enter(Phase.STOPPING)
        log.info("stopping: closing connections and marking the arena clean")
        if self.self_drain is not None:
            self.self_drain.stop()
        if self.handoff is not None:
            self.handoff.stop()
        if self.agent is not None:
            self.agent.stop()
        self.service.stop()
        self.shm.stop()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.stop()
        if self.handoff is not None and not self.handoff.join(5.0):  # it pins the tier
            log.error("the handoff worker did not stop within 5 s; closing the tier anyway")
        if self.self_drain is not None:
            self.self_drain.join(1.0)  # its tick reads the tier's stats
        if self.agent is not None:
            # before the tier closes: a heartbeat reads its stats; before a deregistration:
            # a heartbeat after it would register the member again
            beating = not self.agent.join(3.0 if deregister else 1.0)
            if deregister and beating:
                log.warning("drained, but not deregistered: a heartbeat was still in "
                            "flight; gcache admin remove %s forgets the member", self.cfg.name)
            elif deregister and self.self_drain is not None:
                self.self_drain.deregister()
            elif not beating and self.agent.registered.is_set():
                self._leave_down()
        if self.kv_events is not None:  # before the tier closes: a snapshot walks it
            self.kv_events.stop()
        self._close_storage()
        if self.cfg.remove_arena_on_exit:
            try:
                os.unlink(self.arena_path)
            except OSError:
                pass
            EpochFile(epoch_path(self.arena_path)).remove()
        log.info("stopped")

    def _leave_down(self) -> None:
        """A stop without a drain: mark this member down at the masters now (bounded by
        1 s), so clients route around it at once instead of after the heartbeat timeout;
        it stays a member, and a restart under its name comes back warm."""
        try:
            self.agent.leave("down", time.monotonic() + 1.0)
            log.info("stopping: member %s marked down at the masters", self.cfg.name)
        except (MasterError, MasterUnavailable) as exc:
            log.warning("stopping: could not mark member %s down (%s); the masters will "
                        "after the heartbeat timeout", self.cfg.name, exc)

    def run(self) -> None:
        """``start``, print ``GCACHE_LISTEN=host:port`` (and ``GCACHE_METRICS=``) on stdout,
        serve until SIGTERM or SIGINT (SIGHUP: ``reload``), then ``stop``. Main thread."""
        self.start()
        stop, again, hup = threading.Event(), threading.Event(), threading.Event()
        relay_signals(stop, hup, again)  # gcache.signals: never Event.set in a handler
        try:
            print(f"GCACHE_LISTEN={self.address}", flush=True)
            if self.metrics_address is not None:
                print(f"GCACHE_METRICS={self.metrics_address}", flush=True)
            while not stop.wait(0.2):
                if hup.is_set():
                    hup.clear()
                    self.reload()
        finally:
            self.stop(self.cfg.drain_on_stop_ms / 1000.0, again)
            sys.stdout.flush()


def epoch_path(arena_file: str) -> str:
    """Where the freshness rule keeps the last ring epoch this server adopted as a ring
    member: next to the arena (``gcache-<name>.epoch``)."""
    return arena_file.rsplit(".arena", 1)[0] + ".epoch"


def _group_id(group: str) -> int | None:
    """--shm-group as a gid (a name or a number); None when unset."""
    if not group:
        return None
    if group.isdigit():
        return int(group)
    import grp

    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ArenaError(f"--shm-group {group!r}: no such group; give an existing group "
                         "name or gid") from None


def _open_disk_tier(cfg: Config, memory_tier: MemoryTier, limits: Limits,
                    events: EventQueue | None) -> Any:
    """The NVMe tier behind the memory tier (a TieredStore over both). A setup fault
    closes the memory tier and raises ServerStartError with what to fix."""
    from gcache.server.disk import SegmentLog
    from gcache.server.tiered_store import TieredStore
    from gcache.server.tiering import PolicyOrder, make_promote_policy

    try:
        disk = SegmentLog(cfg.disk_dir, cfg.name, capacity_bytes=cfg.disk_bytes,
                          segment_bytes=cfg.segment_bytes,
                          max_value_bytes=memory_tier.max_object,
                          max_key_bytes=limits.max_key_bytes,
                          max_namespace_bytes=limits.max_namespace_bytes,
                          direct_io=cfg.disk_direct_io,
                          eviction_policy=make_policy(cfg.eviction_policy),
                          events=events)
    except DiskError as exc:
        memory_tier.close(clean=True)
        raise _refused(str(exc), "cannot open the disk tier: %s", exc) from None
    store = TieredStore(memory_tier, disk,
                        make_promote_policy(cfg.promote_policy, cfg.promote_window_ms),
                        io_threads=cfg.disk_io_threads, compaction=PolicyOrder())
    log.info("disk tier ready", extra={"fields": {"dir": disk.root, "capacity": disk.capacity,
                                                  **disk.recovery, **store.recovery}})
    return store

"""``gcache-server``: one cache daemon per host, memory tier plus optional NVMe tier.

Prints ``GCACHE_LISTEN=host:port`` on stdout once it serves (so ``--listen
127.0.0.1:0`` can pick a free port), logs structured lines on stderr, and stops
cleanly on SIGTERM/SIGINT: connections are closed, the arena is marked clean,
the disk tier (``--disk-dir``/``--disk``) writes its index, and a restart
under the same ``--name`` finds every acknowledged object on both tiers.
SIGHUP re-reads ``--credentials-file`` (a bad file keeps the old credentials and
logs why); connections apply the new grants from their next frame. It also re-reads
``--quota-file`` (per-namespace memory/disk quotas, ``gcache.quotas``) the same way.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import click

from gcache import failpoints
from gcache.config import click_options, load_config
from gcache.credentials import CredentialStore
from gcache.quotas import QuotaStore
from gcache.errors import ConfigError
from gcache.tls import dialer_context, listener_context
from gcache.logs import setup_logging
from gcache.protocol import Limits
from gcache.server.arena import Arena, ArenaError, arena_path, header_len
from gcache.server.memory_tier import MemoryTier
from gcache.server.metrics import MetricsEndpoint, ServerMetrics
from gcache.network import check_bind
from gcache.server import nixl_ops, shm_ops
from gcache.server.service import Service, listen_on

log = logging.getLogger("gcache.server")


def build_limits(cfg) -> Limits:
    biggest = cfg.slab_bytes - header_len(cfg.max_namespace_bytes, cfg.max_key_bytes)
    return Limits(max_key_bytes=cfg.max_key_bytes, max_namespace_bytes=cfg.max_namespace_bytes,
                  max_value_bytes=min(cfg.max_value_bytes, biggest),
                  max_batch_items=cfg.max_batch_items, max_header_bytes=cfg.max_header_bytes,
                  max_frame_bytes=cfg.max_frame_bytes)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False),
              help="TOML config file ([server] table). Precedence: file < env < flags.")
@click.option("--memory", "memory", default=None, help="Alias of --memory-bytes, e.g. 4GiB.")
@click.option("--disk", "disk", default=None, help="Alias of --disk-bytes, e.g. 512GiB.")
@click_options("server")
def main(config_file: str | None, memory: str | None, disk: str | None,
         **flags: object) -> None:
    """Run a gcache-server: a shared-memory cache tier (and, with --disk-dir, an NVMe tier
    behind it) serving wire protocol v1."""
    if memory is not None:
        flags["memory_bytes"] = memory
    if disk is not None:
        flags["disk_bytes"] = disk
    try:
        cfg = load_config("server", config_file, cli=flags)
        failpoints.configure(cfg.failpoints)
        tls = listener_context(cfg)  # bad certificate files fail here, before the arena
        masters_tls = dialer_context(cfg)
        if tls is not None and cfg.nixl == "on":
            raise ConfigError("--nixl on with TLS: nixl moves bytes by RDMA outside the TLS "
                              "channel, and TLS clients never use it; use --nixl off (or "
                              "auto, which is off under TLS)")
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    setup_logging(cfg.log_level, cfg.log_format)
    log.info("starting gcache-server", extra={"fields": {"config": cfg.describe(),
                                                         "pid": os.getpid()}})
    try:
        credentials = CredentialStore(cfg.credentials_file, cfg.token)
        quotas = QuotaStore(cfg.quota_file)
    except ConfigError as exc:
        log.error("%s", exc)
        raise SystemExit(f"gcache-server: {exc}") from None
    try:  # before the arena exists: a refusal leaves nothing
        check_bind(cfg.listen, credentials.required)
        if cfg.metrics_listen:  # /metrics and /healthz describe the server to any reader
            check_bind(cfg.metrics_listen, credentials.required, "--metrics-listen")
    except ValueError as exc:
        log.error("%s", exc)
        raise SystemExit(f"gcache-server: {exc}") from None
    path = arena_path(cfg.shm_dir, cfg.name)
    try:
        arena = Arena(path, cfg.memory_bytes, cfg.slab_bytes, prefault=cfg.prefault,
                      group=_group_id(cfg.shm_group))
    except ArenaError as exc:
        log.error("cannot open arena: %s", exc)
        raise SystemExit(f"gcache-server: {exc}") from None
    if arena.reused:
        log.info("reusing arena %s (%s; previous stop was %s)", path, arena.reuse_reason,
                 "clean" if arena.was_clean else "a crash: verifying every object")
    else:
        log.info("clean start of arena %s: %s", path, arena.reuse_reason)

    def stats() -> dict:  # called once svc exists (heartbeats, scrapes)
        s = tier.stats()
        s["connections"] = svc.connections
        s.update(shm.stats(nixl is not None))
        return s

    metrics = ServerMetrics(cfg.metrics_max_namespaces)
    memory_tier = MemoryTier(arena, high_watermark=cfg.high_watermark,
                             low_watermark=cfg.low_watermark,
                             pending_put_timeout_ms=cfg.pending_put_timeout_ms,
                             quotas=quotas, on_quota=metrics.quota_event)
    log.info("arena ready", extra={"fields": {k: v for k, v in memory_tier.recovery.items()}})
    limits = build_limits(cfg)
    shm = shm_ops.ShmRegistry()  # GCACHE_SHM_LEASE_MS is read here
    tier = memory_tier if not cfg.disk_dir else _open_disk_tier(cfg, memory_tier, limits)
    try:
        # under TLS nixl stays off: its bytes would bypass the TLS channel
        nixl = nixl_ops.start("off" if tls is not None else cfg.nixl, arena, cfg.name,
                              shm.lease_ms)
    except Exception as exc:  # NixlUnavailable, or the backend refused the registration
        tier.close(clean=True)
        log.error("cannot start the nixl transport: %s", exc)
        raise SystemExit(f"gcache-server: cannot start the nixl transport (--nixl on): {exc}"
                         ) from None

    try:
        listener = listen_on(cfg.listen, credentials.required)
    except (ValueError, OSError) as exc:
        if nixl is not None:
            nixl.close()
        tier.close(clean=True)
        log.error("cannot listen on %s: %s", cfg.listen, exc)
        raise SystemExit(f"gcache-server: cannot listen on {cfg.listen}: {exc}") from None
    agent = None
    if cfg.masters:
        from gcache.server.agent import MembershipAgent

        advertise = cfg.advertise or listener.address
        if advertise.rsplit(":", 1)[0].strip("[]") in ("0.0.0.0", "::"):
            import socket

            advertise = f"{socket.getfqdn()}:{advertise.rsplit(':', 1)[1]}"
        # the masters take the server's credential (one with server = true), else the token
        agent = MembershipAgent(cfg.masters, cfg.credential or cfg.token, cfg.name, advertise,
                                tier.capacity, stats, cfg.heartbeat_interval_ms,
                                tls=masters_tls)
    svc = Service(tier, listener=listener, name=cfg.name, token=cfg.token, limits=limits,
                  metrics=metrics, max_connections=cfg.max_connections,
                  credentials=credentials,
                  max_preauth_connections=cfg.max_preauth_connections,
                  max_preauth_per_ip=cfg.max_preauth_per_ip,
                  handshake_timeout_ms=cfg.handshake_timeout_ms,
                  send_timeout_ms=cfg.send_timeout_ms,
                  request_timeout_ms=cfg.request_timeout_ms, tls=tls, quotas=quotas,
                  shm_trusted_writers=cfg.shm_trusted_writers, shm=shm, ownership=agent,
                  nixl_info=nixl.info if nixl is not None else None)
    if agent is not None:
        agent.start()  # in the background: serving never waits for the masters
    http = None
    if cfg.metrics_listen:
        http = MetricsEndpoint(cfg.metrics_listen, metrics, stats_fn=stats,
                               usage_fn=tier.namespace_usage, quotas=quotas,
                               health_fn=lambda: {"status": "ok", "name": cfg.name, **stats()},
                               tls=tls)
        http.start()
        log.info("metrics on %s://%s:%d/metrics", http.scheme, *http.address)
    shm.start()
    tier.start()
    svc.start()
    stop, hup = threading.Event(), threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: hup.set())  # reloaded below, not in the handler
    log.info("serving", extra={"fields": {"listen": svc.address, "name": cfg.name,
                                          "tls": "mtls" if cfg.tls_require_client_cert
                                          else "on" if tls is not None else "off"}})
    print(f"GCACHE_LISTEN={svc.address}", flush=True)
    if http is not None:
        print(f"GCACHE_METRICS={http.address[0]}:{http.address[1]}", flush=True)
    while not stop.wait(0.2):
        if hup.is_set():
            hup.clear()
            credentials.reload()
            quotas.reload()
    log.info("stopping: closing connections and marking the arena clean")
    if agent is not None:
        agent.stop()
    svc.stop()
    shm.stop()
    if http is not None:
        http.stop()
    if agent is not None:
        agent.join(1.0)  # before the tier closes: a heartbeat reads its stats
    if nixl is not None:
        nixl.close()  # explicit: a NIXL agent left to interpreter exit can crash it
    tier.close(clean=True)
    if cfg.remove_arena_on_exit:
        try:
            os.unlink(path)
        except OSError:
            pass
    log.info("stopped")
    sys.stdout.flush()


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


def _open_disk_tier(cfg, memory_tier: MemoryTier, limits: Limits):
    """The NVMe tier behind the memory tier; a setup fault exits with what to fix."""
    from gcache.server.segment_log import DiskError, SegmentLog
    from gcache.server.tiered_store import TieredStore
    from gcache.server.tiering import make_promote_policy

    try:
        disk = SegmentLog(cfg.disk_dir, cfg.name, capacity_bytes=cfg.disk_bytes,
                          segment_bytes=cfg.segment_bytes,
                          max_value_bytes=memory_tier.max_object,
                          max_key_bytes=limits.max_key_bytes,
                          max_namespace_bytes=limits.max_namespace_bytes,
                          direct_io=cfg.disk_direct_io)
    except DiskError as exc:
        memory_tier.close(clean=True)
        log.error("cannot open the disk tier: %s", exc)
        raise SystemExit(f"gcache-server: {exc}") from None
    store = TieredStore(memory_tier, disk,
                        make_promote_policy(cfg.promote_policy, cfg.promote_window_ms),
                        io_threads=cfg.disk_io_threads)
    log.info("disk tier ready", extra={"fields": {"dir": disk.root, "capacity": disk.capacity,
                                                  **disk.recovery, **store.recovery}})
    return store


if __name__ == "__main__":
    main()

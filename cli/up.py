"""``gcache up``: a local cluster on loopback, optionally driving a workload through it.

``gcache up`` starts N gcache-server processes on loopback (unique arena
names), prints ``GCACHE_SERVERS=host:port,...`` once all are serving, and
then either serves in the foreground with a live status line until SIGINT or
SIGTERM, or (``--workload`` / ``--trace``) drives a KV-page workload through
the SDK, prints a results table, and shuts the cluster down.

Application layer: it imports the SDK and the bench lazily, inside the command.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time

import click

from gcache.config import TRANSPORTS, TransportKind, format_size, parse_size
from gcache.signals import relay_signals
from gcache.view import MemberState


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command()
@click.option("--servers", "n", type=click.IntRange(1, 64), default=3, show_default=True,
              help="Number of gcache-server processes.")
@click.option("--masters", "n_masters", type=click.IntRange(0, 7), default=3, show_default=True,
              help="Number of gcache-master processes (0 = static server list, no master).")
@click.option("--memory", default="512MiB", show_default=True, callback=_size,
              help="Arena size of each server.")
@click.option("--slab-bytes", default="16MiB", show_default=True, callback=_size,
              help="Slab page size (largest object a server holds).")
@click.option("--token", default="", help="Shared auth token for servers and the workload.")
@click.option("--workload", type=click.Choice(["none", "sessions"]), default="none",
              show_default=True, help="Drive a multi-turn chat KV-page workload, then exit.")
@click.option("--trace", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Replay a Mooncake FAST'25 trace (JSONL with hash_ids), then exit.")
@click.option("--page-bytes", default="256KiB", show_default=True, callback=_size,
              help="Bytes per KV page (one page = 64 tokens for sessions, 512 for traces).")
@click.option("--sessions", default=64, show_default=True, help="Sessions (sessions workload).")
@click.option("--turns", default=6, show_default=True, help="Turns per session.")
@click.option("--limit", type=int, default=None, help="Replay at most this many requests.")
@click.option("--concurrency", default=4, show_default=True,
              help="Engine threads issuing requests.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="Also write the workload report as JSON.")
@click.option("--keep-arenas", is_flag=True, help="Leave the arena files in /dev/shm on exit.")
@click.option("--transport", type=click.Choice(TRANSPORTS), default="auto",
              show_default=True, help="The workload client's data path; nixl also starts the "
              "servers with --nixl on (UCX over loopback unless UCX_NET_DEVICES is set).")
@click.option("--tls", is_flag=True, help="TLS everywhere: make a throwaway CA and "
              "certificates in the log directory, start masters and servers with them "
              "(data port, master API and metrics speak TLS only) and run the workload over "
              "TLS with a client certificate.")
@click.option("--mtls", is_flag=True, help="With --tls: servers and masters also require "
              "client certificates.")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Keep every master's and server's log (and the --tls material) in this "
                   "directory. Default: one temporary directory, removed when the cluster "
                   "stops after a clean run, kept (and named) when a run failed.")
def up(n: int, n_masters: int, memory: int, slab_bytes: int, token: str, workload: str,
       trace: str | None, page_bytes: int, sessions: int, turns: int, limit: int | None,
       concurrency: int, json_out: str | None, keep_arenas: bool, transport: str, tls: bool,
       mtls: bool, log_dir: str | None) -> None:
    """Start a local cluster of N servers on 127.0.0.1 (foreground)."""
    from rich.console import Console

    from gcache.testing.cluster import Cluster

    console = Console(stderr=True)
    extra: list[str] = []
    if mtls and not tls:
        raise click.UsageError("--mtls needs --tls")
    if tls and transport == TransportKind.NIXL:
        raise click.UsageError("--transport nixl cannot run under --tls: nixl moves bytes by "
                               "RDMA outside the TLS channel; use tcp, shm or auto")
    if transport == TransportKind.NIXL:
        from gcache.nixl_lib import available

        if available():
            raise click.UsageError(f"--transport nixl: {available()}")
        os.environ.setdefault("UCX_NET_DEVICES", "lo")  # servers inherit it
        extra = ["--nixl", "on"]
    own_logs = log_dir is None
    logs = tempfile.mkdtemp(prefix="gcache-up-") if own_logs else log_dir
    os.makedirs(logs, exist_ok=True)
    code = 1  # until the run ends cleanly: a failed run keeps its logs
    try:
        files = None
        if tls:
            from gcache.testing.certs import make_certs

            files = make_certs(os.path.join(logs, "tls"))
        # The masters' own Raft secret: fresh per cluster, in their environment only (pysyncobj
        # unpickles what it decrypts with it, so servers and the workload never see it).
        cluster = Cluster(n, format_size(memory), slab=format_size(slab_bytes), token=token,
                          log_dir=logs, prefix=f"up{int(time.time()) % 100000}",
                          keep_arenas=keep_arenas, masters=n_masters, heartbeat_timeout_ms=3000,
                          extra=extra, tls=files, mtls=mtls, raft_secret=secrets.token_hex(32))
        console.print(f"starting {n_masters} gcache-master(s) and {n} gcache-server(s), "
                      f"{format_size(memory)} each{', TLS' + (' + mTLS' if mtls else '') if tls else ''}"
                      f"; logs in {logs}", soft_wrap=True)
        try:
            cluster.start()
            if n_masters:
                _wait_registered(cluster, token, n)
                print(f"GCACHE_MASTERS={','.join(cluster.master_addresses)}", flush=True)
                # the live cluster page: any master serves it (sign in with --token if set)
                print(f"GCACHE_CLUSTER_PAGE={'https' if files else 'http'}://"
                      f"{cluster.master_addresses[0]}/ui", flush=True)
            print(f"GCACHE_SERVERS={','.join(cluster.addresses)}", flush=True)
            if files is not None:  # what `gcache status --masters ...` and clients need
                print(f"GCACHE_TLS_CA_FILE={files.ca_file}", flush=True)
                print(f"GCACHE_TLS_CERT_FILE={files.client_cert_file}", flush=True)
                print(f"GCACHE_TLS_KEY_FILE={files.client_key_file}", flush=True)
            stop = threading.Event()
            relay_signals(stop)  # gcache.signals: never Event.set in a handler
            if workload != "none" or trace:
                code = _run_workload(console, cluster, token, workload, trace, page_bytes,
                                     sessions, turns, limit, concurrency, json_out, stop, transport)
            else:
                _serve_status(console, cluster, token, stop)
                code = 0
        finally:
            console.print("stopping the cluster")
            cluster.close()
    finally:
        if own_logs and code == 0:
            shutil.rmtree(logs, ignore_errors=True)
        else:
            console.print(f"logs kept in {logs}", soft_wrap=True)
    sys.exit(code)


def _serve_status(console, cluster, token: str, stop: threading.Event) -> None:
    from rich.live import Live

    with _client_for(cluster, token, namespace="status") as c, \
            Live(console=console, refresh_per_second=2, transient=True) as live:
        while not stop.wait(1.0):
            stats = c.stats(timeout_ms=500)
            used = sum(s.get("used_bytes", 0) for s in stats.values())
            cap = sum(s.get("capacity_bytes", 0) for s in stats.values())
            objs = sum(s.get("objects", 0) for s in stats.values())
            down = sum(1 for s in stats.values() if "error" in s)
            live.update(f"[bold]gcache up[/] {len(stats) - down}/{len(stats)} servers up | "
                        f"{objs:,} objects | {format_size(used, approx=True)} / "
                        f"{format_size(cap, approx=True)} used | "
                        "Ctrl-C to stop")


def _wait_registered(cluster, token: str, n: int, timeout: float = 30.0) -> None:
    """Block until all n servers are up in the masters' view."""
    from gcache.discovery import MasterClient, MasterUnavailable

    mc = MasterClient(cluster.master_addresses, token, tls=_cluster_tls(cluster))
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            doc = mc.view()
            if sum(m["state"] == MemberState.UP for m in doc["members"]) >= n:
                return
        except (MasterUnavailable, OSError, ValueError):
            pass
        time.sleep(0.1)
    raise click.ClickException(f"servers did not all register with the masters in {timeout}s")


def _cluster_tls(cluster):
    """The dialer context of a ``gcache up --tls`` cluster's own clients, or None."""
    if cluster.tls is None:
        return None
    from gcache.tls import client_context

    f = cluster.tls
    return client_context(f.ca_file, f.client_cert_file, f.client_key_file)


def _client_for(cluster, token: str, **kw):
    from gcache.sdk import Client

    if cluster.tls is not None:
        kw.update(cluster.tls.client_kwargs())
    if cluster.masters:
        return Client(masters=cluster.master_addresses, token=token, **kw)
    return Client(cluster.addresses, token=token, **kw)


def _run_workload(console, cluster, token: str, workload: str, trace: str | None,
                  page_bytes: int, sessions: int, turns: int, limit: int | None,
                  concurrency: int, json_out: str | None, stop: threading.Event,
                  transport: str = "auto") -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.table import Table

    from gcache.bench.replay import replay
    from gcache.bench.workload import mooncake_trace, session_workload

    if trace:
        source = mooncake_trace(trace, limit)
        total = limit or sum(1 for line in open(trace) if line.strip())
    else:
        source = session_workload(sessions=sessions, turns=turns)
        total = min(limit or sessions * turns, sessions * turns)
    name = "mooncake trace" if trace else "sessions"
    servers = cluster.addresses
    with _client_for(cluster, token, namespace=f"up-{name.split()[0]}", timeout_ms=5000,
                     transport=transport) as c, \
            Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                     TextColumn("hit {task.fields[hit]:.1%}"), console=console,
                     transient=True) as prog:
        task = prog.add_task(f"replaying {name}", total=total, hit=0.0)

        def on_step(rep) -> None:
            prog.update(task, completed=rep.steps, hit=rep.hit_rate)
            if stop.is_set():
                raise SystemExit(130)

        rep = replay(c, source, source=name, block_tokens=source.block_tokens,
                     page_bytes=page_bytes, concurrency=concurrency, limit=limit, on_step=on_step)
    s = rep.summary()
    table = Table(title=f"gcache up: {name} workload over {len(servers)} servers "
                        f"({transport} transport{', TLS' if cluster.tls else ''})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("requests", f"{s['steps']:,}"), ("pages (tokens)", f"{s['pages']:,} ({s['tokens']:,})"),
        ("token hit rate", f"{s['token_hit_rate']:.1%}"),
        ("pages read / written", f"{s['pages_hit']:,} / {s['pages_put']:,}"),
        ("bytes read / written", f"{format_size(s['bytes_got'], approx=True)} / "
                                 f"{format_size(s['bytes_put'], approx=True)}"),
        ("throughput", f"{s['gbps']:.2f} GB/s, {s['steps_per_s']:,} req/s"),
        ("request latency p50 / p99", f"{s['step_p50_ms']} / {s['step_p99_ms']} ms"),
        ("wrong values", str(s["wrong_values"])),
        ("lost after exists", str(s["lost_after_exists"])),
        ("put failures", json.dumps(s["put_failures"]) if s["put_failures"] else "0"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(s, f, indent=2)
    return 1 if s["wrong_values"] else 0


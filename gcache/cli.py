"""``gcache``: the operator command. ``gcache up`` runs a local cluster.

``gcache up`` starts N gcache-server processes on loopback (unique arena
names), prints ``GCACHE_SERVERS=host:port,...`` once all are serving, and
then either serves in the foreground with a live status line until SIGINT or
SIGTERM, or (``--workload`` / ``--trace``) drives a KV-page workload through
the SDK, prints a results table, and shuts the cluster down.

This module is the application layer: it may import the SDK and bench code
(lazily, inside commands); the core modules never do.
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import threading
import time

import click

from gcache.config import format_size, parse_size

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(context_settings=CONTEXT)
def main() -> None:
    """gcache: distributed, tiered KV-cache store for LLM inference."""


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@main.command()
@click.option("--servers", "n", type=click.IntRange(1, 64), default=3, show_default=True,
              help="Number of gcache-server processes.")
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
def up(n: int, memory: int, slab_bytes: int, token: str, workload: str, trace: str | None,
       page_bytes: int, sessions: int, turns: int, limit: int | None, concurrency: int,
       json_out: str | None, keep_arenas: bool) -> None:
    """Start a local cluster of N servers on 127.0.0.1 (foreground)."""
    from rich.console import Console

    from gcache.testing.cluster import Cluster

    console = Console(stderr=True)
    logs = tempfile.mkdtemp(prefix="gcache-up-")
    cluster = Cluster(n, format_size(memory), slab=format_size(slab_bytes), token=token,
                      log_dir=logs, prefix=f"up{int(time.time()) % 100000}",
                      keep_arenas=keep_arenas)
    console.print(f"starting {n} gcache-server(s), {format_size(memory)} each; logs in {logs}")
    cluster.start()
    print(f"GCACHE_SERVERS={','.join(cluster.addresses)}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    code = 0
    try:
        if workload != "none" or trace:
            code = _run_workload(console, cluster.addresses, token, workload, trace, page_bytes,
                                 sessions, turns, limit, concurrency, json_out, stop)
        else:
            _serve_status(console, cluster, token, stop)
    finally:
        console.print("stopping the cluster")
        cluster.close()
    sys.exit(code)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _serve_status(console, cluster, token: str, stop: threading.Event) -> None:
    from rich.live import Live

    from gcache.sdk import Client

    with Client(cluster.addresses, token=token, namespace="status") as c, \
            Live(console=console, refresh_per_second=2, transient=True) as live:
        while not stop.wait(1.0):
            stats = c.stats(timeout_ms=500)
            used = sum(s.get("used_bytes", 0) for s in stats.values())
            cap = sum(s.get("capacity_bytes", 0) for s in stats.values())
            objs = sum(s.get("objects", 0) for s in stats.values())
            down = sum(1 for s in stats.values() if "error" in s)
            live.update(f"[bold]gcache up[/] {len(stats) - down}/{len(stats)} servers up | "
                        f"{objs:,} objects | {_human(used)} / {_human(cap)} used | "
                        "Ctrl-C to stop")


def _run_workload(console, servers: list[str], token: str, workload: str, trace: str | None,
                  page_bytes: int, sessions: int, turns: int, limit: int | None,
                  concurrency: int, json_out: str | None, stop: threading.Event) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.table import Table

    from gcache.bench.replay import replay
    from gcache.bench.workload import mooncake_trace, session_workload
    from gcache.sdk import Client

    if trace:
        source = mooncake_trace(trace, limit)
        total = limit or sum(1 for line in open(trace) if line.strip())
    else:
        source = session_workload(sessions=sessions, turns=turns)
        total = min(limit or sessions * turns, sessions * turns)
    name = "mooncake trace" if trace else "sessions"
    with Client(servers, token=token, namespace=f"up-{name.split()[0]}", timeout_ms=5000) as c, \
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
    table = Table(title=f"gcache up: {name} workload over {len(servers)} servers")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("requests", f"{s['steps']:,}"), ("pages (tokens)", f"{s['pages']:,} ({s['tokens']:,})"),
        ("token hit rate", f"{s['token_hit_rate']:.1%}"),
        ("pages read / written", f"{s['pages_hit']:,} / {s['pages_put']:,}"),
        ("bytes read / written", f"{_human(s['bytes_got'])} / {_human(s['bytes_put'])}"),
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


if __name__ == "__main__":
    main()

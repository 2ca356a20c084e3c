"""``gcache-bench``: throughput and latency of put/get batches, next to raw TCP.

    gcache-bench --local 1 --memory 4GiB --size 64KiB --size 1MiB --batch 64
    gcache-bench --servers 10.0.0.1:7600,10.0.0.2:7600 --op get --concurrency 4

Design: the CLI only wires things up. It starts a local ``Cluster`` (or uses
``--servers``), measures the raw-socket baseline once, then runs every case
(op x size x batch x concurrency) through ``runner.run_case`` with a rich
progress bar, prints one table, and optionally writes the whole run as JSON.
Any non-OK status (or oracle mismatch with ``--verify``) makes the exit code
1, so a short run doubles as a CI smoke test.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import sys
from contextlib import ExitStack
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gcache.bench.runner import cluster_capacity, measure_baseline, raw_gbps, run_case
from gcache.config import format_size, parse_size
from gcache.errors import ConfigError
from gcache.sdk import Client


def _size(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Click callback: parse_size for one value or a tuple of values."""
    try:
        if isinstance(value, tuple):
            return tuple(parse_size(v) for v in value)
        return None if value is None else parse_size(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None


def machine_info() -> dict[str, Any]:
    try:
        from importlib.metadata import version
        gcache_version = version("gcache")
    except Exception:
        gcache_version = "unknown"
    return {"platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "gcache": gcache_version}


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def render_table(cases: list[dict[str, Any]], baseline: dict[str, Any] | None) -> Table:
    title = "gcache-bench"
    if baseline:
        rtt = baseline["rtt"]
        title += f"  (raw TCP 64 B RTT p50 {rtt['p50_us']:.1f} µs, p99 {rtt['p99_us']:.1f} µs)"
    t = Table(title=title)
    cols = ["op", "size", "batch", "conc", "GB/s", "keys/s", "p50 µs", "p99 µs", "µs/key",
            "errors"] + (["raw GB/s", "vs raw"] if baseline else [])
    for col in cols:
        t.add_column(col, justify="left" if col == "op" else "right")
    for c in cases:
        row = [c["op"], format_size(c["size"]), str(c["batch"]), str(c["concurrency"]),
               _fmt(c["gbps"]), _fmt(c["keys_per_s"], ",.0f"), _fmt(c["p50_us"], ",.0f"),
               _fmt(c["p99_us"], ",.0f"), _fmt(c["key_p50_us"], ",.1f"),
               f"[red]{c['errors']}[/]" if c["errors"] else "0"]
        if baseline:
            row += [_fmt(raw_gbps(baseline, c["op"], c["size"])),
                    "-" if c["vs_raw"] is None else f"{c['vs_raw']:.0%}"]
        t.add_row(*row)
    return t


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--servers", help="Comma-separated host:port list of running servers.")
@click.option("--local", type=click.IntRange(min=1), help="Start N local servers for the run.")
@click.option("--memory", default="2GiB", show_default=True, callback=_size,
              help="Arena size per --local server.")
@click.option("--slab-bytes", default="16MiB", show_default=True, callback=_size,
              help="Slab size per --local server (largest value is a bit less).")
@click.option("--op", "ops", multiple=True, type=click.Choice(["get", "put"]),
              default=("put", "get"), show_default=True)
@click.option("--size", "sizes", multiple=True, default=("64KiB", "1MiB", "4MiB"),
              show_default=True, callback=_size, help="Value size (repeatable).")
@click.option("--batch", "batches", multiple=True, type=click.IntRange(min=1), default=(64,),
              show_default=True, help="Keys per call (repeatable; 1 = single-key latency).")
@click.option("--concurrency", "concurrencies", multiple=True, type=click.IntRange(min=1),
              default=(1,), show_default=True, help="Client threads issuing calls (repeatable).")
@click.option("--duration", type=click.FloatRange(min=0, min_open=True),
              help="Seconds per case [default: 3, unless --iters is given].")
@click.option("--iters", type=click.IntRange(min=1), help="Calls per thread per case.")
@click.option("--timeout-ms", type=click.IntRange(min=1), default=10000, show_default=True,
              help="Deadline of one call.")
@click.option("--token", default="", help="Shared secret of the servers.")
@click.option("--namespace", default="bench", show_default=True)
@click.option("--conns-per-server", type=click.IntRange(min=1), help="SDK connections/server.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True),
              help="Write machine info, baseline and cases to this file.")
@click.option("--no-baseline", is_flag=True, help="Skip the raw-socket baseline.")
@click.option("--verify", is_flag=True, help="Check every get against the value oracle.")
@click.pass_context
def main(ctx: click.Context, servers: str | None, local: int | None, memory: int,
         slab_bytes: int, ops: tuple[str, ...], sizes: tuple[int, ...],
         batches: tuple[int, ...], concurrencies: tuple[int, ...], duration: float | None,
         iters: int | None, timeout_ms: int, token: str, namespace: str,
         conns_per_server: int | None, json_path: str | None, no_baseline: bool,
         verify: bool) -> None:
    """Benchmark gcache put/get batches against a raw loopback-TCP baseline."""
    if (servers is None) == (local is None):
        raise click.UsageError("give exactly one of --servers HOST:PORT,... or --local N")
    if duration is None and iters is None:
        duration = 3.0
    err = Console(stderr=True)
    cases = list(itertools.product(dict.fromkeys(ops), dict.fromkeys(sizes),
                                   dict.fromkeys(batches), dict.fromkeys(concurrencies)))
    results: list[dict[str, Any]] = []
    baseline = None
    with ExitStack() as stack:
        if local is not None:
            from gcache.testing.cluster import Cluster

            err.print(f"starting {local} local server(s): {format_size(memory)} arena, "
                      f"{format_size(slab_bytes)} slabs")
            cluster = Cluster(local, format_size(memory), slab=format_size(slab_bytes),
                              token=token, prefix=f"bench{os.getpid()}")
            stack.callback(cluster.close)
            addresses = cluster.start().addresses
        else:
            addresses = [s.strip() for s in servers.split(",") if s.strip()]
        client = Client(addresses, namespace=namespace, timeout_ms=timeout_ms, token=token,
                        conns_per_server=conns_per_server)
        stack.callback(client.close)
        capacity = cluster_capacity(client)
        progress = stack.enter_context(Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
            "{task.total}"), TimeElapsedColumn(), console=err, transient=True))
        task = progress.add_task("baseline", total=len(cases))
        if not no_baseline:
            progress.update(task, description="raw-socket baseline")
            baseline = measure_baseline(list(dict.fromkeys(sizes)))
        for i, (op, size, batch, conc) in enumerate(cases):
            progress.update(task, description=f"{op} {format_size(size)} x{batch} c{conc}")
            row = run_case(client, op, size, batch, conc, duration=duration, iters=iters,
                           verify=verify, capacity=capacity, tag=str(i))
            raw = raw_gbps(baseline, op, size)
            row["vs_raw"] = row["gbps"] / raw if raw else None
            results.append(row)
            progress.advance(task)
    out = Console()
    if not out.is_terminal:  # piped / CI: do not squeeze the table into 80 columns
        out = Console(width=max(out.width, 132))
    out.print(render_table(results, baseline))
    if json_path:
        doc = {"machine": machine_info(), "command": " ".join(sys.argv),
               "servers": addresses,
               "local": {"servers": local, "memory": memory, "slab_bytes": slab_bytes}
               if local else None,
               "settings": {"duration": duration, "iters": iters, "verify": verify,
                            "timeout_ms": timeout_ms, "capacity_bytes": capacity,
                            "conns_per_server": client.conns, "slice_bytes": client.slice},
               "baseline": baseline, "cases": results}
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    errors = sum(r["errors"] for r in results)
    if errors:
        err.print(f"[red]{errors} error(s)[/]: " + ", ".join(
            f"{r['op']} {format_size(r['size'])} x{r['batch']} c{r['concurrency']}: "
            f"{r['error_kinds']}" for r in results if r["errors"]))
        ctx.exit(1)


if __name__ == "__main__":
    main()

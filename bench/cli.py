"""``gcache-bench``: throughput and latency of put/get batches, next to raw TCP.

    gcache-bench --local 1 --memory 4GiB --size 64KiB --size 1MiB --batch 64
    gcache-bench --servers 10.0.0.1:7600,10.0.0.2:7600 --op get --concurrency 4
    gcache-bench --local 1 --tier disk --op get --size 1MiB --demotion-impact
    gcache-bench --local 1 --op get --sweep --transport tcp --transport shm --transport nixl \
        --plot bench/out/transports.png --json bench/out/transports.json
    gcache-bench --local 1 --raw-transport --transport shm --transport nixl --size 1MiB
    gcache-bench blast-radius --local 4 --local 8    # sessions hit by one server's death
    gcache-bench trace TRACE.jsonl --capacity 0.05 --policy lru --policy reuse --plot hit.png

Design: the CLI only wires things up. It starts a local ``Cluster`` (or uses
``--servers``), measures the raw-socket baseline once, then runs every case
(op x size x batch x concurrency) through ``runner.run_case`` with a rich
progress bar, prints one table, and optionally writes the whole run as JSON.
Every shm batch case is preceded by a single-thread memcpy of its value size
(``runner.measure_memcpy``; columns "memcpy GB/s" and "vs memcpy").
Any non-OK status (or oracle mismatch with ``--verify``) makes the exit code
1, so a short run doubles as a CI smoke test.

Transports: every case runs once per ``--transport`` (tcp, shm, nixl, auto) and
per ``--threads`` (dispatch threads = connections per server), each with its own
Client. ``--local`` servers get ``--nixl on`` when nixl is asked for (UCX over
loopback). With nixl the bench registers its buffers (``register_buffer``) unless
``--no-register``. ``--sweep`` sizes 64 KiB ... 64 MiB; ``--max-batch-bytes`` caps
keys per call for large sizes. ``--raw-transport`` replaces the cases by the raw
single-process transport reads of ``raw_transport``. ``--plot FILE.png`` draws GB/s
against size, one line per transport and op (matplotlib).

Subcommands run other benchmarks on their own options: ``blast-radius``
(``blast_radius``: sessions whose prefix chain loses a page when one server dies,
chain against key placement) and ``trace`` (``trace``: token hit rate per eviction
policy and capacity on a Mooncake trace, through a real server, next to the ceiling
and the Belady oracle).

``--tls`` runs every client connection over TLS: ``--local`` servers get a
throwaway CA and certificates (``gcache.testing.certs``) and speak TLS only;
with ``--servers`` give ``--tls-ca-file`` (and ``--tls-cert-file``/
``--tls-key-file`` for mTLS). The raw-socket baseline stays plain TCP, so "vs
raw" then includes the cost of TLS; run the same command without ``--tls`` for
the plain figures (bench/RESULTS.md records both).

``--tier disk`` (with ``--local``) gives the server an NVMe tier in
``--disk-dir``, a small memory tier (128 MiB unless ``--memory`` is given) and
``promote_policy=never``, so gets are served from disk. Each get case then
waits for demotion to settle and measures ``disk_baseline.measure_raw_pread``
over the server's own segment files (same records, O_DIRECT like the server,
one thread per client connection) before it times the gets: "pread GB/s" and
"vs pread" in the table. ``--demotion-impact`` adds foreground get latency on
a hot set alone and under a paced background put stream, on the disk-tier
server (the mover demotes) and on a memory-only control server (it evicts).
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Any

import click
from click.core import ParameterSource
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gcache import __version__
from gcache.bench.blast_radius import main as blast_radius_main
from gcache.bench.capacity import main as capacity_main
from gcache.bench.plot import needs_matplotlib
from gcache.bench.trace import main as trace_main
from gcache.bench.runner import (cluster_capacity, measure_baseline, measure_memcpy, raw_gbps,
                                 raw_latency, run_case, run_demotion_impact)
from gcache.bench.disk_baseline import measure_raw_pread
from gcache.bench.runner import TARGET_BYTES
from gcache.config import format_size, parse_size
from gcache.errors import ConfigError
from gcache.sdk import Client

SWEEP_SIZES = tuple(64 << 10 << (2 * i) for i in range(6))  # 64 KiB ... 64 MiB


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
        title += f"  (raw TCP 64 B RTT p50 {rtt['p50_us']:.1f} µs, p99 {rtt['p99_us']:.1f} µs"
        for size, r in baseline.get("request_reply", {}).items():
            title += f"; 64 B -> {size} reply p50 {r['p50_us']:.1f} µs"
        title += ")"
    t = Table(title=title)
    disk = any("raw_disk" in c for c in cases)
    single = bool(baseline) and any(raw_latency(baseline, c["op"], c["size"])
                                    and c["batch"] == 1 for c in cases)
    cols = ["transport", "threads", "op", "size", "batch", "conc", "GB/s", "keys/s", "p50 µs", "p99 µs", "µs/key",
            "errors"] + (["raw GB/s", "vs raw"] if baseline else []) + (
            ["raw p50 µs", "p50/raw"] if single else []) + (
            ["from disk", "pread GB/s", "vs pread"] if disk else [])
    memcpy = any(c.get("memcpy_gbps") for c in cases)
    cols += ["memcpy GB/s", "vs memcpy"] if memcpy else []
    for col in cols:
        t.add_column(col, justify="left" if col in ("op", "transport") else "right")
    for c in cases:
        row = [c.get("transport", "auto") + ("+tls" if c.get("tls") else ""),
               str(c.get("threads", "-")), c["op"],
               format_size(c["size"]), str(c["batch"]), str(c["concurrency"]),
               _fmt(c["gbps"]), _fmt(c["keys_per_s"], ",.0f"), _fmt(c["p50_us"], ",.0f"),
               _fmt(c["p99_us"], ",.0f"), _fmt(c["key_p50_us"], ",.1f"),
               f"[red]{c['errors']}[/]" if c["errors"] else "0"]
        if baseline:
            row += [_fmt(raw_gbps(baseline, c["op"], c["size"])),
                    "-" if c["vs_raw"] is None else f"{c['vs_raw']:.0%}"]
        if single:
            lat = raw_latency(baseline, c["op"], c["size"]) if c["batch"] == 1 else None
            row += [_fmt(lat, ",.1f"), "-" if not lat else f"{c['p50_us'] / lat:.2f}x"]
        if disk:
            rd = c.get("raw_disk")
            row += ["-" if c.get("disk_fraction") is None else f"{c['disk_fraction']:.0%}",
                    _fmt(rd["gbps"]) if rd else "-",
                    f"{c['vs_pread']:.0%}" if c.get("vs_pread") else "-"]
        if memcpy:
            row += [_fmt(c.get("memcpy_gbps")),
                    f"{c['vs_memcpy']:.0%}" if c.get("vs_memcpy") else "-"]
        t.add_row(*row)
    return t


def render_impact(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="foreground get latency, alone vs under background puts")
    for col in ("server", "size", "batch", "bg MB/s", "idle p50 µs", "idle p99 µs",
                "busy p50 µs", "busy p99 µs", "busy/idle p99", "demoted MB/s", "evicted",
                "errors"):
        t.add_column(col, justify="left" if col == "server" else "right")
    for r in rows:
        t.add_row(r["server"], format_size(r["size"]), str(r["batch"]), f"{r['bg_mbps']:.0f}",
                  _fmt(r["idle"]["p50_us"], ",.0f"), _fmt(r["idle"]["p99_us"], ",.0f"),
                  _fmt(r["busy"]["p50_us"], ",.0f"), _fmt(r["busy"]["p99_us"], ",.0f"),
                  _fmt(r["p99_ratio"]), _fmt(r["busy_demoted_mbps"], ".0f"),
                  str(r["busy_evictions"]), str(r["idle"]["errors"] + r["busy"]["errors"]))
    return t


def _wait_settled(client: Client, quiet_s: float = 0.5, timeout_s: float = 120.0) -> dict:
    """Wait until the servers' demotion counters stop moving; returns the last stats."""
    end = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < end:
        st = client.stats()
        now = {a: (s.get("demoted"), s.get("used_bytes")) for a, s in st.items()}
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return st
        time.sleep(0.1)
    return client.stats()


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
             invoke_without_command=True)
@click.version_option(__version__, "-V", "--version", prog_name="gcache-bench")
@click.option("--servers", help="Comma-separated host:port list of running servers.")
@click.option("--local", type=click.IntRange(min=1), help="Start N local servers for the run.")
@click.option("--memory", default="2GiB", show_default=True, callback=_size,
              help="Arena size per --local server (128MiB with --tier disk unless given).")
@click.option("--slab-bytes", default="16MiB", show_default=True, callback=_size,
              help="Slab size per --local server (largest value is a bit less).")
@click.option("--op", "ops", multiple=True, type=click.Choice(["get", "put", "exists"]),
              default=("put", "get"), show_default=True,
              help="Op (repeatable). Single-key rows (--batch 1) of get and exists show "
              "their p50 against the raw baseline: a 64 B request answered by --size bytes "
              "(get), the 64 B round trip (exists).")
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
@click.option("--token", default="", help="Shared secret of the servers (legacy: full rights).")
@click.option("--credential", default="", envvar="GCACHE_CREDENTIAL",
              help="'id:secret' of the --servers' credentials file; needs write and read on "
              "--namespace (and admin on \"*\" for the STATS-based numbers). "
              "[env GCACHE_CREDENTIAL]")
@click.option("--namespace", default="bench", show_default=True)
@click.option("--conns-per-server", type=click.IntRange(min=1), help="SDK connections/server.")
@click.option("--transport", "transports", multiple=True,
              type=click.Choice(["tcp", "shm", "nixl", "auto"]), default=("auto",),
              show_default=True, help="Client data path (repeatable: one run per transport).")
@click.option("--threads", "threads_list", multiple=True, type=click.IntRange(min=1),
              help="Dispatch threads (connections) per server (repeatable sweep; "
              "default --conns-per-server).")
@click.option("--sweep", is_flag=True, help="Sizes 64KiB, 256KiB, 1MiB, 4MiB, 16MiB, 64MiB.")
@click.option("--max-batch-bytes", default="256MiB", show_default=True, callback=_size,
              help="Cap keys per call at this many bytes (large sizes use smaller batches).")
@click.option("--raw-transport", is_flag=True, help="Measure raw single-process transport "
              "reads (no SDK dispatch) per transport, size and --concurrency.")
@click.option("--no-register", is_flag=True,
              help="nixl: do not register bench buffers (measure the staged path).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True),
              help="Write a PNG of GB/s against size per transport and op.",
              callback=needs_matplotlib)
@click.option("--log-dir", type=click.Path(file_okay=False),
              help="Write the --local servers' logs here (one file per server).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True),
              help="Write machine info, baseline and cases to this file.")
@click.option("--no-baseline", is_flag=True, help="Skip the raw-socket baseline.")
@click.option("--verify", is_flag=True, help="Check every get against the value oracle.")
@click.option("--checksums", type=click.Choice(["on", "off", "both"]), default="on",
              show_default=True, help="SDK verification of every get against the server's "
              "checksum (Client verify_checksums); 'both' runs every case with it on and "
              "off (rows 'TRANSPORT/noverify'), to measure its cost in one run.")
@click.option("--tier", type=click.Choice(["memory", "disk"]), default="memory",
              show_default=True, help="disk: serve gets from a --local server's NVMe tier and "
              "compare with a raw pread of its segment files.")
@click.option("--disk-dir", type=click.Path(file_okay=False),
              help="Parent directory of the disk tier [default: a new temp dir in /var/tmp].")
@click.option("--disk-bytes", default="8GiB", show_default=True, callback=_size,
              help="Disk tier capacity per --local server (--tier disk).")
@click.option("--disk-working-set", default="1GiB", show_default=True, callback=_size,
              help="Bytes per disk-tier case (the memory tier holds a small part).")
@click.option("--raw-threads", type=click.IntRange(min=1),
              help="Threads of the raw pread baseline [default: client connections/server].")
@click.option("--demotion-impact", is_flag=True,
              help="Also measure get p99 under background demotion (needs --tier disk).")
@click.option("--bg-mbps", type=click.FloatRange(min=1), default=200.0, show_default=True,
              help="Pace of the background put stream of --demotion-impact (MB/s).")
@click.option("--impact-size", default="64KiB", show_default=True, callback=_size,
              help="Value size of the --demotion-impact foreground gets.")
@click.option("--impact-batch", type=click.IntRange(min=1), default=16, show_default=True,
              help="Keys per foreground get of --demotion-impact (hot set: 4 batches).")
@click.option("--impact-memory", default="512MiB", show_default=True, callback=_size,
              help="Arena of the two --demotion-impact servers (disk tier, memory only).")
@click.option("--tls", is_flag=True, help="Every client connection over TLS (--local: "
              "servers with throwaway certificates, TLS only).")
@click.option("--tls-ca-file", help="With --servers --tls: the CA of their certificates.")
@click.option("--tls-cert-file", help="With --servers --tls: client certificate (mTLS).")
@click.option("--tls-key-file", help="Key of --tls-cert-file.")
@click.pass_context
def main(ctx: click.Context, servers: str | None, local: int | None, memory: int,
         slab_bytes: int, ops: tuple[str, ...], sizes: tuple[int, ...],
         batches: tuple[int, ...], concurrencies: tuple[int, ...], duration: float | None,
         iters: int | None, timeout_ms: int, token: str, credential: str, namespace: str,
         conns_per_server: int | None, json_path: str | None, no_baseline: bool,
         verify: bool, tier: str, disk_dir: str | None, disk_bytes: int,
         disk_working_set: int, raw_threads: int | None, demotion_impact: bool,
         bg_mbps: float, impact_size: int, impact_batch: int, impact_memory: int,
         transports: tuple[str, ...], threads_list: tuple[int, ...], sweep: bool,
         max_batch_bytes: int, raw_transport: bool, no_register: bool,
         plot_path: str | None, log_dir: str | None, checksums: str, tls: bool,
         tls_ca_file: str | None, tls_cert_file: str | None, tls_key_file: str | None
         ) -> None:
    """Benchmark gcache put/get batches against a raw loopback-TCP baseline
    (and, with --tier disk, the disk tier against a raw pread of its files).
    Other benchmarks are subcommands (gcache-bench COMMAND --help)."""
    if ctx.invoked_subcommand is not None:
        return  # a subcommand runs on its own options
    if (servers is None) == (local is None):
        raise click.UsageError("give exactly one of --servers HOST:PORT,... or --local N")
    if tier == "disk" and local is None:
        raise click.UsageError("--tier disk needs --local N (the bench reads the server's "
                               "segment files for its raw baseline)")
    if demotion_impact and tier != "disk":
        raise click.UsageError("--demotion-impact needs --tier disk")
    if credential and local is not None:
        raise click.UsageError("--credential is for --servers; the --local servers take "
                               "--token")
    if duration is None and iters is None:
        duration = 3.0
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    if sweep:
        sizes = SWEEP_SIZES
    transports = tuple(dict.fromkeys(transports))
    if raw_transport and "auto" in transports:
        raise click.UsageError("--raw-transport measures one transport at a time: give "
                               "--transport tcp|shm|nixl")
    if raw_transport and (tier == "disk" or duration is None):
        raise click.UsageError("--raw-transport needs the memory tier and a --duration")
    if tls and ("nixl" in transports or raw_transport or demotion_impact):
        raise click.UsageError("--tls measures the SDK's tcp/shm/auto transports: drop "
                               "nixl, --raw-transport and --demotion-impact")
    if tls and local is not None and (tls_ca_file or tls_cert_file or tls_key_file):
        raise click.UsageError("--local --tls makes its own certificates; --tls-*-file "
                               "options are for --servers")
    if "nixl" in transports:
        from gcache.nixl_lib import available

        why = available()
        if why:
            raise click.UsageError(f"--transport nixl: {why}")
        os.environ.setdefault("UCX_NET_DEVICES", "lo")  # before any agent exists
    need_slab = max(sizes) + (64 << 10)
    if local is not None and slab_bytes < need_slab:
        slab_bytes = 1 << (need_slab - 1).bit_length()
        if memory < 4 * slab_bytes:
            memory = 4 * slab_bytes
    if tier == "disk" and ctx.get_parameter_source("memory") == ParameterSource.DEFAULT:
        memory = 128 << 20
    err = Console(stderr=True)
    cases = list(itertools.product(dict.fromkeys(ops), dict.fromkeys(sizes),
                                   dict.fromkeys(batches), dict.fromkeys(concurrencies)))
    checks = {"on": (True,), "off": (False,), "both": (True, False)}[checksums]
    runs = [(t, th, v) for t in transports for v in checks
            for th in dict.fromkeys(threads_list) or (conns_per_server,)]
    results: list[dict[str, Any]] = []
    clients: dict[tuple[str, int | None], Client] = {}
    impact: list[dict[str, Any]] = []
    baseline = None
    disk_roots: list[str] = []
    tls_kw: dict[str, Any] = {}
    if tls:
        tls_kw = {"tls": True, "tls_ca_file": tls_ca_file, "tls_cert_file": tls_cert_file,
                  "tls_key_file": tls_key_file}
    with ExitStack() as stack:
        tls_files = None
        if local is not None and tls:
            from gcache.testing.certs import make_certs

            cert_dir = tempfile.mkdtemp(prefix="gcache-bench-tls-")
            stack.callback(shutil.rmtree, cert_dir, True)
            tls_files = make_certs(cert_dir)
            tls_kw = tls_files.client_kwargs()
        if local is not None:
            from gcache.testing.cluster import Cluster

            extra: list[str] = []
            if tier == "disk":
                parent = disk_dir or tempfile.mkdtemp(prefix="gcache-bench-disk-",
                                                      dir="/var/tmp")
                if disk_dir is None:
                    stack.callback(shutil.rmtree, parent, True)
                extra = ["--disk-dir", parent, "--disk", format_size(disk_bytes),
                         "--promote-policy", "never"]
            if "nixl" in transports:
                extra += ["--nixl", "on"]
            err.print(f"starting {local} local server(s): {format_size(memory)} arena, "
                      f"{format_size(slab_bytes)} slabs"
                      + (f", {format_size(disk_bytes)} disk tier in {parent}"
                         if tier == "disk" else ""))
            cluster = Cluster(local, format_size(memory), slab=format_size(slab_bytes),
                              token=token, prefix=f"bench{os.getpid()}", extra=extra,
                              log_dir=log_dir, tls=tls_files)
            stack.callback(cluster.close)
            addresses = cluster.start().addresses
            if tier == "disk":
                from gcache.server.disk import tier_root

                disk_roots = [tier_root(parent, s.name) for s in cluster.servers]
        else:
            addresses = [s.strip() for s in servers.split(",") if s.strip()]
        client = Client(addresses, namespace=namespace, timeout_ms=timeout_ms, token=token,
                        credential=credential or None, conns_per_server=conns_per_server,
                        transport="tcp", **tls_kw)
        stack.callback(client.close)
        capacity = cluster_capacity(client)
        target = TARGET_BYTES
        if tier == "disk":
            capacity = sum(s.get("disk_capacity_bytes", 0) for s in client.stats().values())
            target = disk_working_set
        raw_threads = raw_threads or client.conns
        # prefill calls must fit the memory tier: puts in flight cannot be demoted
        prefill_bytes = min(64 << 20, memory // 4) if tier == "disk" else 64 << 20
        progress = stack.enter_context(Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
            "{task.total}"), TimeElapsedColumn(), console=err, transient=True))
        task = progress.add_task("baseline", total=len(cases) * len(runs))
        if not no_baseline:
            progress.update(task, description="raw-socket baseline")
            baseline = measure_baseline(list(dict.fromkeys(sizes)))
        if raw_transport:
            progress.update(task, total=len(runs) * len(sizes) * len(concurrencies))
        for i, ((transport, threads, checked), (op, size, batch, conc)) in enumerate(
                itertools.product(runs, [] if raw_transport else cases)):
            run_client = clients.get((transport, threads, checked))
            if run_client is None:
                run_client = clients[(transport, threads, checked)] = Client(
                    addresses, namespace=namespace, timeout_ms=timeout_ms, token=token,
                    credential=credential or None, conns_per_server=threads,
                    transport=transport, verify_checksums=checked, **tls_kw)
                stack.callback(run_client.close)
            batch = min(batch, max(1, max_batch_bytes // size))
            label = f"{transport} t{run_client.conns} {op} {format_size(size)} x{batch} c{conc}"
            progress.update(task, description=label)
            before: dict[str, dict] = {}
            raws: list[dict[str, Any]] = []
            hook = round_hook = None
            rounds = 1
            if tier == "disk" and op == "get" and duration is not None:
                # the raw pread baseline runs before every round, moments from the gets it is
                # compared with: this disk's throughput drifts by +-25 % second to second
                rounds = max(1, min(5, int(duration)))
                direct = [True]

                def hook(before: dict = before, direct: list = direct,
                         label: str = label) -> dict[str, Any]:
                    progress.update(task, description="waiting for demotion to settle")
                    before.update(_wait_settled(client))
                    direct[0] = bool(before[addresses[0]].get("disk_direct_io", 1))
                    progress.update(task, description=label + " (alternating with raw pread)")
                    return {}

                def round_hook(direct: list = direct, raws: list = raws,
                               seconds: float = duration / rounds) -> float:
                    raw = measure_raw_pread(disk_roots[0], threads=raw_threads,
                                            seconds=seconds, direct=direct[0])
                    raws.append(raw)
                    return raw["gbps"]
            # shm moves values with memcpy: its single-thread ceiling, moments before
            mc = measure_memcpy(size) if transport == "shm" and batch > 1 else None
            row = run_case(run_client, op, size, batch, conc, duration=duration, iters=iters,
                           verify=verify, capacity=capacity, tag=str(i), target=target,
                           after_prefill=hook, rounds=rounds, before_round=round_hook,
                           prefill_bytes=prefill_bytes,
                           register=transport == "nixl" and not no_register)
            row["transport"] = transport if checked else f"{transport}/noverify"
            row["threads"], row["verify_checksums"] = run_client.conns, checked
            row["tls"] = tls
            raw = raw_gbps(baseline, op, size)
            row["vs_raw"] = row["gbps"] / raw if raw else None
            row["memcpy_gbps"] = mc
            row["vs_memcpy"] = row["gbps"] / mc if mc else None
            if raws:
                after = client.stats()
                hits = sum(s.get("disk_hits", 0) for s in after.values()) - sum(
                    s.get("disk_hits", 0) for s in before.values())
                served = row["keys_per_s"] * row["seconds"]
                row["disk_fraction"] = min(1.0, hits / served) if served else None
                row["raw_disk"] = {"gbps": statistics.median(r["gbps"] for r in raws),
                                   "threads": raws[0]["threads"],
                                   "direct_io": raws[0]["direct_io"],
                                   "records": raws[0]["records"], "rounds": raws}
                row["vs_pread"] = statistics.median(row["round_ratios"])
            results.append(row)
            progress.advance(task)
        if raw_transport:
            from gcache.bench.raw_transport import measure_raw_transport

            for (transport, _threads, _checked), size, conc in itertools.product(
                    runs, dict.fromkeys(sizes), dict.fromkeys(concurrencies)):
                count = max(1, min(64, max_batch_bytes // size))
                progress.update(task, description=f"raw {transport} {format_size(size)} "
                                f"x{count} c{conc}")
                row = measure_raw_transport(addresses[0], transport, size=size, count=count,
                                            seconds=duration, threads=conc, token=token,
                                            credential=credential)
                row.update(threads=1, errors=0, error_kinds={}, p50_us=None, p99_us=None,
                           key_p50_us=None, vs_raw=None)
                raw = raw_gbps(baseline, "get", size)
                row["vs_raw"] = row["gbps"] / raw if raw else None
                results.append(row)
                progress.advance(task)
        if demotion_impact:
            # two fresh servers of the same size: one demotes to its disk tier, the control
            # (memory only) evicts; same hot set, same paced background put stream
            for label, with_disk in (("disk tier (demotes)", True),
                                     ("memory only (evicts)", False)):
                progress.update(task, description=f"get latency under background puts: "
                                f"{label}")
                ex = (["--disk-dir", parent, "--disk", format_size(disk_bytes),
                       "--promote-policy", "never"] if with_disk else [])
                srv = Cluster(1, format_size(impact_memory), slab=format_size(slab_bytes),
                              token=token, prefix=f"bench{os.getpid()}{'d' if with_disk else 'm'}",
                              extra=ex, log_dir=log_dir)
                try:
                    r = run_demotion_impact(srv.start().addresses, size=impact_size,
                                            batch=impact_batch, seconds=duration or 3.0,
                                            bg_mbps=bg_mbps, token=token,
                                            bg_size=min(1 << 20, slab_bytes // 2))
                finally:
                    srv.close()
                impact.append({"server": label, "memory": impact_memory, **r})
    out = Console()
    if not out.is_terminal:  # piped / CI: do not squeeze the table into 80 columns
        out = Console(width=max(out.width, 132))
    out.print(render_table(results, baseline))
    if plot_path:
        from gcache.bench.plot import plot_gbps

        plot_path = plot_gbps(results, plot_path, title=" ".join(sys.argv[1:]))
        err.print(f"plot written to {plot_path}")
    if impact:
        out.print(render_impact(impact))
    if json_path:
        doc = {"machine": machine_info(), "command": " ".join(sys.argv),
               "servers": addresses,
               "local": {"servers": local, "memory": memory, "slab_bytes": slab_bytes,
                         "tier": tier, "disk_bytes": disk_bytes if tier == "disk" else None}
               if local else None,
               "settings": {"duration": duration, "iters": iters, "verify": verify,
                            "transports": list(transports), "raw_transport": raw_transport,
                            "tls": tls,
                            "max_batch_bytes": max_batch_bytes,
                            "timeout_ms": timeout_ms, "capacity_bytes": capacity,
                            "conns_per_server": client.conns, "slice_bytes": client.slice},
               "baseline": baseline, "cases": results, "demotion_impact": impact}
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    errors = sum(r["errors"] for r in results)
    if errors:
        err.print(f"[red]{errors} error(s)[/]: " + ", ".join(
            f"{r['op']} {format_size(r['size'])} x{r['batch']} c{r['concurrency']}: "
            f"{r['error_kinds']}" for r in results if r["errors"]))
        ctx.exit(1)


main.add_command(blast_radius_main, "blast-radius")
main.add_command(trace_main, "trace")
main.add_command(capacity_main, "capacity")

if __name__ == "__main__":
    main()

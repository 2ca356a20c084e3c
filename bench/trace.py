"""``gcache-bench trace FILE``: token hit rate per eviction policy and capacity on a
Mooncake FAST'25 trace, through a real local server, next to the infinite-cache
ceiling and the Belady oracle at the same capacity.

    gcache-bench trace mooncake_fast25_synthetic_trace.jsonl \\
        --capacity 0.05 --capacity 0.1 --capacity 0.2 --policy lru --policy reuse \\
        [--disk] [--limit N] [--page-tokens 64] [--offline] [--plot hit.png] [--json out.json]
    gcache-bench trace TRACE --swa [--layers 70 --full-layers 10 --window-tokens 128
        --page-tokens 64 --bytes-per-token-layer 6] --capacity 0.1 --policy lru

Design. For every (capacity, policy) a fresh single ``gcache-server`` is started
(``gcache.testing.cluster``) with ``--eviction-policy`` and an arena that holds exactly
``capacity x unique pages`` page chunks (one 4 KiB size class; the capacity is rounded
up to a whole slab page of 16 chunks), and the trace is replayed through the SDK by
``replay.replay`` with one engine thread (an engine's L3 step per request: exists,
read the prefix checked against the value oracle, put the rest). The memory tier's
watermarks are 1.0 / 0.999, so it evicts only when an allocation finds no room, in
the policy's order, which is what ``trace_sim`` models: its offline number for the same
policy is printed next to the real one ("sim"). ``--disk`` adds an NVMe tier of
``--disk-ratio`` x the memory to every server (default watermarks, so the mover
demotes in the policy's order, and the disk compacts in it) and reports memory + disk hits.

Columns: hit rate (pages hit / pages asked; every page is the same number of tokens,
so this is the token hit rate), the ceiling, Belady at the same capacity, and the
fraction of the LRU -> Belady gap a policy closes ((hit - LRU) / (Belady - LRU)).
``--page-tokens`` splits each 512-token block into finer pages, the page geometry of
``swa_replay`` (its ``requests``), for engines with 64-token pages. ``--offline``
skips the servers (simulation only, seconds). ``--plot`` draws hit rate against
capacity per policy, with the ceiling and Belady (needs matplotlib: ``pip install
gcache[bench]``; checked before anything runs).

``--swa`` keeps ``swa_replay``'s hybrid-SWA geometry: two pools of different page sizes
(KV: the full-attention layers of every page; SWA: the sliding-window layers of the
trailing window only), written and looked up as the SGLang plugin does, and a hit is the
window-safe prefix (``swa_replay.Engine``, layout ``swa``). Capacity is a fraction of
the arena bytes all the trace's KV and SWA pages take (``swa_capacity_bytes``); the
ceiling is the window-safe hit rate of an infinite cache. There is no offline
simulation or Belady oracle for two page sizes (those columns show "-"), so ``--swa``
needs the servers (no ``--offline``) and the memory tier alone (no ``--disk``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Sequence

import click
from rich.console import Console
from rich.table import Table

from gcache.bench.plot import needs_matplotlib
from gcache.bench.trace_sim import (Request, belady, capacity_blocks, ceiling, load_trace,
                                    simulate, unique_blocks)
from gcache.bench.workload import Step
from gcache.config import EVICTION_POLICIES
from gcache.server.arena import arena_bytes_for, header_len, size_class

NAMESPACE = "trace"
CHUNK = 4096  # one size class: every page is one 4 KiB chunk
SLAB = 64 << 10  # the smallest slab page: 16 chunks
PER_SLAB = SLAB // CHUNK


def page_bytes_for(key_len: int) -> int:
    """Value bytes of a page whose chunk (header with placement room + value) is CHUNK."""
    return CHUNK - header_len(len(NAMESPACE), key_len, True)


def arena_bytes(pages: int) -> int:
    """``--memory`` for an arena of exactly ``pages`` / PER_SLAB slab pages of data (the
    arena's own rule, ``arena_bytes_for``)."""
    return arena_bytes_for(pages // PER_SLAB, SLAB)


def round_capacity(pages: int) -> int:
    return max(PER_SLAB, (pages + PER_SLAB - 1) // PER_SLAB * PER_SLAB)


def load_requests(path: str, limit: int | None, page_tokens: int) -> list[Request]:
    """The trace's requests; with ``page_tokens`` < 512 each block is split into pages
    (``swa_replay.requests``: a page key is ``<hash id hex>.<index>``)."""
    if page_tokens == 512:
        return load_trace(path, limit)
    from gcache.bench.swa_replay import Geometry, requests

    geo = Geometry(page_tokens=page_tokens)
    times = [r.t_s for r in load_trace(path, limit)]
    return [Request(tuple(k.encode() for k in r.chain), t)
            for r, t in zip(requests(path, geo, limit), times)]


def replay_real(reqs: Sequence[Request], capacity: int, policy: str, *, disk: bool,
                disk_ratio: int, log_dir: str | None, timeout_ms: int) -> dict[str, Any]:
    """Replay through one fresh local server of ``capacity`` pages ordered by ``policy``."""
    from gcache.bench.replay import replay
    from gcache.sdk import Client
    from gcache.testing.cluster import Cluster

    key_len = max((len(k) for r in reqs for k in r.keys), default=8)
    memory = arena_bytes(capacity)
    extra = ["--eviction-policy", policy]
    tmp = None
    if disk:
        tmp = tempfile.mkdtemp(prefix="gcache-trace-disk-", dir="/var/tmp")
        seg = 4 << 20  # small segments: a small tier still has room to compact
        extra += ["--disk-dir", tmp, "--segment-bytes", str(seg),
                  "--disk", str(max(16 * seg, (disk_ratio * memory + seg - 1) // seg * seg))]
    else:
        extra += ["--high-watermark", "1.0", "--low-watermark", "0.999"]
    try:
        with Cluster(1, str(memory), slab=str(SLAB), extra=extra, log_dir=log_dir,
                     prefix=f"trace{os.getpid()}") as cl:
            with Client(servers=cl.addresses, namespace=NAMESPACE, timeout_ms=timeout_ms,
                        transport="tcp", conns_per_server=1) as client:
                st = next(iter(client.stats().values()))
                if st["pages"] * PER_SLAB != capacity:
                    raise RuntimeError(f"the server's arena holds {st['pages']} slab pages, "
                                       f"not {capacity // PER_SLAB}: arena layout changed?")
                steps = (Step(i, i, r.keys, r.t_s * 1000) for i, r in enumerate(reqs))
                rep = replay(client, steps, source="mooncake", block_tokens=512,
                             page_bytes=page_bytes_for(key_len), concurrency=1)
                st = next(iter(client.stats().values()))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    bad = rep.wrong_values + rep.lost_after_exists + sum(rep.put_failures.values())
    return {"hit_rate": rep.hit_rate, "seconds": rep.seconds, "errors": bad,
            "put_failures": dict(rep.put_failures), "evictions": st.get("evictions", 0),
            "demoted": st.get("demoted", 0), "disk_hits": st.get("disk_hits", 0)}


def swa_capacity_bytes(pages: dict[str, int], geo: Any) -> tuple[int, int]:
    """Arena bytes all ``pages`` (``{"kv": n, "swa": m}`` unique pages) take in the
    ``swa`` layout, and the slab (the largest chunk, at least 64 KiB)."""
    from gcache.bench.swa_replay import pool_specs

    total, largest = 0, SLAB
    for spec in pool_specs("swa", geo):
        key = spec.keys("f" * 16 + ".63")[0]  # a long page key: hash id hex . index
        chunk = size_class(header_len(len(b"swa-replay/swa"), len(key), True)
                           + spec.page_bytes)
        total += pages[spec.name] * chunk
        largest = max(largest, chunk)
    return total, (largest + SLAB - 1) // SLAB * SLAB


def run_swa(path: str, *, fractions: Sequence[float], policies: Sequence[str],
            limit: int | None, geo: Any, log_dir: str | None, timeout_ms: int,
            progress=None) -> dict[str, Any]:  # noqa: ANN001
    """``--swa``: the hybrid-SWA layout through one fresh server per (capacity, policy)."""
    import argparse

    from gcache.bench.swa_replay import requests, run_layout, unbounded_hit_rates

    unb = unbounded_hit_rates(path, geo, limit)
    expected = sum(1 for _ in requests(path, geo, limit))
    pages = {"kv": unb["unique_kv_pages"], "swa": unb["unique_swa_pages"]}
    total, slab = swa_capacity_bytes(pages, geo)
    doc: dict[str, Any] = {"trace": path, "requests": expected,
                           "unique_pages": sum(pages.values()),
                           "unique_kv_pages": pages["kv"], "unique_swa_pages": pages["swa"],
                           "page_tokens": geo.page_tokens, "geometry": dict(geo.__dict__),
                           "swa": True, "ceiling": unb["window_safe_hit_rate"],
                           "disk": False, "rows": []}
    for frac in fractions:
        npages = max(1, -(-int(frac * total) // slab))
        for pol in policies:
            if progress:
                progress(f"replaying the SWA layout: {pol} at {frac:g} ({npages} x "
                         f"{slab >> 10} KiB slab pages)")
            args = argparse.Namespace(servers=1, memory=str(arena_bytes_for(npages, slab)),
                                      slab_bytes=str(slab), timeout_ms=timeout_ms,
                                      group_pages=64, trace=path, limit=limit,
                                      concurrency=1, progress=False)
            rep = run_layout("swa", args, geo, extra=[
                "--eviction-policy", pol, "--high-watermark", "1.0",
                "--low-watermark", "0.999"], log_dir=log_dir)
            unreplayed = expected - rep["requests"]  # a replay thread died: not a result
            doc["rows"].append({
                "capacity_fraction": frac, "capacity_pages": npages * slab // CHUNK,
                "capacity_bytes": npages * slab, "policy": pol, "belady": None, "sim": None,
                "hit_rate": rep["token_hit_rate"], "gap_closed": None,
                "real": {"hit_rate": rep["token_hit_rate"], "seconds": rep["seconds"],
                         "errors": rep["wrong_values"] + rep["lost_after_exists"] + unreplayed,
                         "unreplayed_requests": unreplayed,
                         "evictions": rep["evictions"],
                         "stored_prefix_rate": rep["stored_prefix_rate"]}})
    return doc


def run(path: str, *, fractions: Sequence[float], policies: Sequence[str],
        limit: int | None = None, page_tokens: int = 512, offline: bool = False,
        disk: bool = False, disk_ratio: int = 10, log_dir: str | None = None,
        timeout_ms: int = 10000, progress=None) -> dict[str, Any]:  # noqa: ANN001
    """The whole bench as a document (see the module docstring)."""
    reqs = load_requests(path, limit, page_tokens)
    unique = unique_blocks(reqs)
    doc: dict[str, Any] = {"trace": path, "requests": len(reqs), "unique_pages": unique,
                           "page_tokens": page_tokens, "ceiling": ceiling(reqs),
                           "disk": disk, "rows": []}
    for frac in fractions:
        cap = round_capacity(capacity_blocks(reqs, frac))
        oracle = belady(reqs, cap)
        rows = []
        for pol in policies:
            row: dict[str, Any] = {"capacity_fraction": frac, "capacity_pages": cap,
                                   "policy": pol, "belady": oracle,
                                   "sim": simulate(reqs, cap, pol).hit_rate}
            if not offline:
                if progress:
                    progress(f"replaying {len(reqs)} requests: {pol} at {frac:g} "
                             f"({cap} pages){' + disk' if disk else ''}")
                row["real"] = replay_real(reqs, cap, pol, disk=disk, disk_ratio=disk_ratio,
                                          log_dir=log_dir, timeout_ms=timeout_ms)
            row["hit_rate"] = row["real"]["hit_rate"] if "real" in row else row["sim"]
            rows.append(row)
        lru = next((r["hit_rate"] for r in rows if r["policy"] == "lru"), None)
        if lru is None:  # not replayed: the simulated one
            lru = simulate(reqs, cap, "lru").hit_rate
        for r in rows:
            r["lru"] = lru
            gap = oracle - lru
            # with --disk the memory-sized oracle is no bound: compare with the ceiling
            r["gap_closed"] = (r["hit_rate"] - lru) / gap if gap > 0 and not disk else None
        doc["rows"].extend(rows)
    return doc


def render(doc: dict[str, Any]) -> Table:
    real = any("real" in r for r in doc["rows"])
    t = Table(title=f"token hit rate, {doc['requests']} requests, {doc['unique_pages']} "
              f"unique pages, ceiling {doc['ceiling']:.3f}"
              + (" (memory + NVMe)" if doc["disk"] else "")
              + (" (hybrid SWA: KV + SWA pools, window-safe hits; pages = 4 KiB units)"
                 if doc.get("swa") else ""))
    cols = ["capacity", "pages", "policy", "hit rate"] + (["sim", "s"] if real else []) + \
        ["Belady", "gap closed"]
    for c in cols:
        t.add_column(c, justify="left" if c == "policy" else "right")
    for r in doc["rows"]:
        row = [f"{r['capacity_fraction']:.0%}", str(r["capacity_pages"]), r["policy"],
               f"{r['hit_rate']:.3f}"]
        if real:
            row += ["-" if r["sim"] is None else f"{r['sim']:.3f}",
                    f"{r['real']['seconds']:.0f}"]
        gc = r["gap_closed"]
        row += ["-" if r["belady"] is None else f"{r['belady']:.3f}",
                "-" if gc is None else f"{gc:+.0%}"]
        t.add_row(*row)
    return t


def plot(doc: dict[str, Any], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    rows = doc["rows"]
    caps = sorted({r["capacity_fraction"] for r in rows})
    for pol in dict.fromkeys(r["policy"] for r in rows):
        pts = {r["capacity_fraction"]: r["hit_rate"] for r in rows if r["policy"] == pol}
        ax.plot(caps, [pts[c] for c in caps], marker="o", label=pol)
    bel = {r["capacity_fraction"]: r["belady"] for r in rows if r["belady"] is not None}
    if bel:
        ax.plot(sorted(bel), [bel[c] for c in sorted(bel)], linestyle="--", color="k",
                label="Belady (oracle)")
    ax.axhline(doc["ceiling"], linestyle=":", color="grey", label="infinite cache")
    ax.set_xlabel("capacity (fraction of the trace's unique pages)")
    ax.set_ylabel("token hit rate")
    ax.set_title(os.path.basename(doc["trace"]) + (" (memory + NVMe)" if doc["disk"] else ""),
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("trace_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--capacity", "fractions", multiple=True, type=click.FloatRange(0, 1, min_open=True),
              default=(0.05, 0.1, 0.2), show_default=True,
              help="Capacity as a fraction of the trace's unique pages (repeatable).")
@click.option("--policy", "policies", multiple=True, type=click.Choice(EVICTION_POLICIES),
              default=EVICTION_POLICIES, show_default=True, help="Eviction policy (repeatable).")
@click.option("--limit", type=click.IntRange(min=1), help="First N requests only.")
@click.option("--page-tokens", type=click.Choice(["512", "256", "128", "64"]), default=None,
              help="Tokens per page (swa_replay's page geometry)  [default: 512; 64 with "
                   "--swa]")
@click.option("--swa", is_flag=True, help="swa_replay's hybrid-SWA geometry: KV and SWA "
              "pools of different page sizes, window-safe hits (servers only).")
@click.option("--layers", type=click.IntRange(min=2), default=70, show_default=True,
              help="--swa: model layers.")
@click.option("--full-layers", type=click.IntRange(min=1), default=10, show_default=True,
              help="--swa: full-attention layers (the rest are sliding-window).")
@click.option("--window-tokens", type=click.IntRange(min=1), default=128, show_default=True,
              help="--swa: sliding-window length.")
@click.option("--bytes-per-token-layer", type=click.IntRange(min=1), default=6,
              show_default=True, help="--swa: bytes per token per layer (scales sizes).")
@click.option("--disk", is_flag=True, help="Memory + an NVMe tier of --disk-ratio x memory.")
@click.option("--disk-ratio", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--offline", is_flag=True, help="Simulation only (no servers).")
@click.option("--timeout-ms", type=click.IntRange(min=1), default=10000, show_default=True)
@click.option("--log-dir", type=click.Path(file_okay=False), help="Server logs here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True),
              help="Write a PNG of hit rate against capacity per policy (matplotlib).",
              callback=needs_matplotlib)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True),
              help="Write the whole run here.")
def main(trace_file: str, fractions: tuple[float, ...], policies: tuple[str, ...],
         limit: int | None, page_tokens: str | None, swa: bool, layers: int,
         full_layers: int, window_tokens: int, bytes_per_token_layer: int, disk: bool,
         disk_ratio: int, offline: bool, timeout_ms: int, log_dir: str | None,
         plot_path: str | None, json_path: str | None) -> None:
    """Replay a Mooncake FAST'25 JSONL trace: hit rate per eviction policy and capacity,
    next to the infinite-cache ceiling and the Belady oracle."""
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.UsageError("--plot needs matplotlib: pip install 'gcache[bench]'") \
                from None
    if disk and offline:
        raise click.UsageError("--offline simulates the memory tier only; drop --disk")
    if swa and (offline or disk):
        raise click.UsageError("--swa replays through servers, memory tier only: drop "
                               "--offline and --disk")
    if swa and full_layers >= layers:
        raise click.UsageError(f"--full-layers {full_layers} must be below --layers {layers}")
    err = Console(stderr=True)
    t0 = time.monotonic()
    fracs, pols = sorted(set(fractions)), list(dict.fromkeys(policies))
    if swa:
        from gcache.bench.swa_replay import Geometry

        geo = Geometry(layers, full_layers, window_tokens, int(page_tokens or 64),
                       bytes_per_token_layer)
        doc = run_swa(trace_file, fractions=fracs, policies=pols, limit=limit, geo=geo,
                      log_dir=log_dir, timeout_ms=timeout_ms,
                      progress=lambda msg: err.print(msg))
    else:
        doc = run(trace_file, fractions=fracs, policies=pols, limit=limit,
                  page_tokens=int(page_tokens or 512), offline=offline, disk=disk,
                  disk_ratio=disk_ratio, log_dir=log_dir, timeout_ms=timeout_ms,
                  progress=lambda msg: err.print(msg))
    doc["seconds"] = round(time.monotonic() - t0, 1)
    doc["command"] = " ".join(sys.argv)
    out = Console()
    if not out.is_terminal:
        out = Console(width=max(out.width, 120))
    out.print(render(doc))
    if plot_path:
        err.print(f"plot written to {plot(doc, plot_path)}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    errors = sum(r["real"]["errors"] for r in doc["rows"] if "real" in r)
    if errors:
        err.print(f"[red]{errors} error(s)[/] (wrong values, lost reads or failed puts)")
        raise SystemExit(1)

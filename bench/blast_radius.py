"""Blast radius of one server's death: the sessions whose prefix chain loses a page,
``chain`` placement against ``key`` placement.

    gcache-bench blast-radius                                # ring code, N = 4, 8, 64, 512
    gcache-bench blast-radius --local 4 --local 8 --json out.json   # and real processes
    python -m gcache.bench.blast_radius ...                  # the same command

The MiMo article (§2.2) groups session ids into logical sets spread over the nodes, so
that one node loss truncates few sessions. In gcache that mechanism is the ops'
``group=`` argument (every key of a group lands on one server) and the SGLang plugin's
``chain`` placement, which passes it. This bench measures what it buys.

Workload (``make_workload``, seeded): ``sessions`` sessions; session ``s`` holds a
prefix chain of ``P_s`` pages, ``P_s`` uniform in ``[min_pages, max_pages]``; page
``i``'s key is ``"<session token>/<i>"`` (a stand-in for SGLang's page hash), one
object per page. Chains share no pages, unless ``shared_pages`` is set: then each
session's chain starts with the first ``shared_pages`` pages of one of ``prompts``
shared prompts (``"prompt<k>/<i>"``, a system prompt; one object however many sessions
use it), chosen uniformly.

Placements (``Placement``):

* ``key``: every page by its own key hash (``group=None``; the plugin's ``key`` policy).
* ``chain/G``: the plugin's rule, ``chain_groups(None, chain, G)``: runs of ``G`` pages,
  each named by its first page's key, passed as ``group=`` one per key. With ``G`` at
  least the longest chain (``G = 64``, the plugin's default, against chains of at most
  64 pages) a session is one group named by its first page: the same placement as
  ``group=<session id>``, one server per session. Sessions that share a prompt share
its first run's group (it is named by the prompt's first page), so their first runs
land on one server.

Ring code (``owners``, ``blast_radius``): placement hashes come from
``gcache.sdk.routing.placement_hashes`` and owners from ``View.static(addresses).ring``,
the code the SDK routes by. For every server ``d`` that may die: the sessions hit (at
least one page on ``d``), the pages lost (the objects on ``d``, as a fraction of all
objects) and the prefix lost (for each hit session, its pages from the first one on
``d`` to the end of the chain, since prefix reuse stops at the first missing page; as a
fraction of all sessions' chain pages). Mean and max over ``d``, next to the
uniform-share expectation of the sessions hit, ``1 - (1 - 1/N)^R`` per session, ``R`` =
the runs of its chain (pages, under ``key``; shown without shared prompts only). The
cost: load, the objects (= bytes: pages have one size) per server, max over mean.

Real processes (``measure_real``): ``N`` local servers (static view, no masters); the
workload is written through ``Client.put_batch`` once per placement, each in its own
namespace (``<namespace>/<placement>``) with the same keys and values from the value
oracle, and read back (every page must be a verified hit). One server, chosen by the
seed, is killed with SIGKILL, and every page is read again: a session is hit when a
page of its chain misses. The sessions hit must be exactly the ones the ring code
predicts for that server (same addresses, same hashes), and no read may return a
wrong value.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any, NamedTuple, Sequence

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from gcache.config import format_size, parse_size
from gcache.errors import ConfigError
from gcache.sdk.client import Client
from gcache.sdk.routing import placement_hashes
from gcache.sdk.sglang.chain_store import chain_groups
from gcache.status import Status
from gcache.testing.oracle import check_value, value_for
from gcache.view import View

RING_SERVERS = (4, 8, 64, 512)
IO_BATCH = 512  # keys per put/get call of the real-process run


class Placement(NamedTuple):
    """``key`` (group_pages 0: every page by its own hash) or ``chain/G``."""

    group_pages: int

    @property
    def label(self) -> str:
        return f"chain/{self.group_pages}" if self.group_pages else "key"


KEY = Placement(0)


class Workload(NamedTuple):
    """Sessions' prefix chains, page by page: session 0's chain, then session 1's, ..."""

    namespace: bytes
    pages: list[str]          # page keys
    session: np.ndarray       # session index of each page
    position: np.ndarray      # chain position of each page
    lengths: np.ndarray       # pages per session
    stored: np.ndarray        # bool: the first page with its key (one object per key)
    shared: bool              # chains start with shared prompts

    @property
    def keys(self) -> list[bytes]:
        return [p.encode() for p in self.pages]

    def namespace_of(self, placement: Placement) -> bytes:
        """Each placement is written to its own namespace (same keys, same values)."""
        return self.namespace + b"/" + placement.label.encode()

    def groups(self, placement: Placement) -> list[str] | None:
        """The ``group=`` list of every page (None under ``key``): the plugin's rule."""
        if not placement.group_pages:
            return None
        out: list[str] = []
        lo = 0
        for n in self.lengths.tolist():
            out += chain_groups(None, self.pages[lo:lo + n], placement.group_pages)
            lo += n
        return out


def make_workload(sessions: int, min_pages: int, max_pages: int, seed: int,
                  namespace: bytes = b"blast", shared_pages: int = 0,
                  prompts: int = 1) -> Workload:
    """``sessions`` chains of ``min_pages..max_pages`` pages (uniform), from ``seed``;
    each starts with ``shared_pages`` pages of one of ``prompts`` shared prompts."""
    if sessions < 1 or not 1 <= min_pages <= max_pages or shared_pages < 0 or prompts < 1:
        raise ValueError("need sessions >= 1, 1 <= min_pages <= max_pages, "
                         "shared_pages >= 0 and prompts >= 1")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_pages, max_pages + 1, size=sessions, dtype=np.int64)
    tokens = rng.integers(0, 2**63, size=sessions, dtype=np.int64).tolist()
    prompt = rng.integers(0, prompts, size=sessions).tolist()
    pages = [f"prompt{k}/{i}" if i < shared_pages else f"{t:016x}/{i}"
             for t, k, n in zip(tokens, prompt, lengths.tolist()) for i in range(n)]
    session = np.repeat(np.arange(sessions, dtype=np.int64), lengths)
    starts = np.cumsum(lengths) - lengths
    position = np.arange(len(pages), dtype=np.int64) - np.repeat(starts, lengths)
    first: dict[str, int] = {}
    for i, p in enumerate(pages):
        first.setdefault(p, i)
    stored = np.zeros(len(pages), dtype=bool)
    stored[list(first.values())] = True
    return Workload(namespace, pages, session, position, lengths, stored, shared_pages > 0)


def ring_addresses(n: int) -> list[str]:
    """Server addresses of a simulated N-server cluster (member id = address, as in a
    static view)."""
    return [f"10.{i >> 8}.{i & 255}.1:7600" for i in range(n)]


def owners(workload: Workload, placement: Placement, addresses: Sequence[str]) -> np.ndarray:
    """The owner of every page (an index into ``addresses``), as the SDK routes it in a
    static view of ``addresses``."""
    hashes = placement_hashes(workload.namespace_of(placement), workload.keys,
                              workload.groups(placement))
    index = {a: i for i, a in enumerate(addresses)}
    members = View.static(list(addresses)).ring.owners(hashes)
    return np.fromiter((index[m.address] for m in members), dtype=np.int64,
                       count=len(hashes))


def sessions_hit(workload: Workload, owner: np.ndarray, dead: int) -> np.ndarray:
    """Per session: does its chain have a page on server ``dead``?"""
    return np.bincount(workload.session[owner == dead],
                       minlength=len(workload.lengths)) > 0


def expected_hit(workload: Workload, placement: Placement, n: int) -> float:
    """Uniform-share expectation of the sessions hit: mean of ``1 - (1 - 1/n)^R``,
    ``R`` = runs per chain (pages under ``key``); chains share no pages."""
    size = placement.group_pages or 1
    runs = -(-workload.lengths // size)
    return float(np.mean(1.0 - (1.0 - 1.0 / n) ** runs))


def blast_radius(workload: Workload, owner: np.ndarray, n: int) -> dict[str, Any]:
    """Sessions hit, pages lost and prefix pages lost for each single-server death
    (mean and max over the ``n`` servers, as fractions), and the load max/mean."""
    sessions, pages = len(workload.lengths), len(owner)
    load = np.bincount(owner[workload.stored], minlength=n)
    objects = int(load.sum())
    # one row per (session, server) pair, at the session's first page on that server
    code = workload.session * n + owner
    order = np.lexsort((workload.position, code))
    code_sorted = code[order]
    first = np.ones(pages, dtype=bool)
    first[1:] = code_sorted[1:] != code_sorted[:-1]
    pair = code_sorted[first]
    pair_session, pair_server = pair // n, pair % n
    cut_at = workload.position[order][first]
    hit = np.bincount(pair_server, minlength=n)
    cut = np.bincount(pair_server, weights=workload.lengths[pair_session] - cut_at,
                      minlength=n)
    return {"servers": n, "sessions": sessions, "pages": pages, "objects": objects,
            "hit_mean": float(hit.mean() / sessions), "hit_max": float(hit.max() / sessions),
            "pages_lost_mean": float(load.mean() / objects),
            "pages_lost_max": float(load.max() / objects),
            "prefix_lost_mean": float(cut.mean() / pages),
            "prefix_lost_max": float(cut.max() / pages),
            "servers_per_session": float(len(pair) / sessions),
            "load_max_over_mean": float(load.max() / load.mean())}


def ring_rows(workload: Workload, placements: Sequence[Placement],
              servers: Sequence[int]) -> list[dict[str, Any]]:
    """``blast_radius`` for every server count and placement, on the real ring code."""
    rows = []
    for n in servers:
        addresses = ring_addresses(n)
        for p in placements:
            row = blast_radius(workload, owners(workload, p, addresses), n)
            rows.append({"placement": p.label, **row, "hit_expected":
                         None if workload.shared else expected_hit(workload, p, n)})
    return rows


def _pick(groups: list[str] | None, index: np.ndarray) -> list[str] | None:
    return None if groups is None else [groups[i] for i in index]


def _read(client: Client, keys: list[bytes], groups: list[str] | None
          ) -> tuple[np.ndarray, int]:
    """Verified hit per key, and the count of wrong values (must be 0)."""
    ok = np.zeros(len(keys), dtype=bool)
    wrong = 0
    for lo in range(0, len(keys), IO_BATCH):
        ks = keys[lo:lo + IO_BATCH]
        got = client.get_batch(ks, group=None if groups is None else groups[lo:lo + IO_BATCH])
        for i, (k, v) in enumerate(zip(ks, got)):
            if v is not None:
                good = check_value(k, v)
                ok[lo + i] = good
                wrong += not good
    return ok, wrong


def measure_real(n: int, workload: Workload, placements: Sequence[Placement], *,
                 page_bytes: int, memory: int, slab_bytes: int, seed: int,
                 timeout_ms: int = 2000, log_dir: str | None = None) -> list[dict[str, Any]]:
    """Write ``workload`` to ``n`` real servers under each placement, kill one with
    SIGKILL (chosen by ``seed``), read every page back, and compare the sessions hit
    with the ring code's prediction for that server. One row per placement."""
    from gcache.testing.cluster import Cluster

    every = workload.keys
    stored = np.flatnonzero(workload.stored)
    keys = [every[i] for i in stored]  # one object per key; shared pages written once
    slot = {k: j for j, k in enumerate(keys)}
    object_of = np.fromiter((slot[k] for k in every), dtype=np.int64, count=len(every))
    values = [value_for(k, page_bytes) for k in keys]
    victim = random.Random(seed).randrange(n)
    rows = []
    with Cluster(n, format_size(memory), slab=format_size(slab_bytes),
                 prefix=f"blast{os.getpid()}n{n}", log_dir=log_dir) as cluster:
        addresses = cluster.addresses
        clients = {p: Client(addresses, namespace=workload.namespace_of(p),
                             timeout_ms=timeout_ms, transport="tcp") for p in placements}
        try:
            for p, client in clients.items():
                groups = _pick(workload.groups(p), stored)
                for lo in range(0, len(keys), IO_BATCH):
                    st = client.put_batch(keys[lo:lo + IO_BATCH], values[lo:lo + IO_BATCH],
                                          group=None if groups is None
                                          else groups[lo:lo + IO_BATCH])
                    bad = [s for s in st if s != Status.OK]
                    if bad:
                        raise RuntimeError(f"{n} servers, {p.label}: put failed ({bad[0]!r}); "
                                           "give the servers more --memory")
                ok, wrong = _read(client, keys, groups)
                if not ok.all() or wrong:
                    raise RuntimeError(f"{n} servers, {p.label}: {int((~ok).sum())} pages "
                                       "missing before the kill (evicted?); give the "
                                       "servers more --memory")
            cluster.servers[victim].kill9()
            for p, client in clients.items():
                owner = owners(workload, p, addresses)
                predicted = sessions_hit(workload, owner, victim)
                t0 = time.monotonic()
                ok, wrong = _read(client, keys, _pick(workload.groups(p), stored))
                read_s = time.monotonic() - t0
                missing = ~ok[object_of]  # per page of every chain
                measured = np.bincount(workload.session[missing],
                                       minlength=len(workload.lengths)) > 0
                rows.append({"servers": n, "placement": p.label, "killed": addresses[victim],
                             "killed_index": victim,
                             "sessions": len(workload.lengths), "objects": len(keys),
                             "hit": float(measured.mean()),
                             "hit_predicted": float(predicted.mean()),
                             "disagree": int((measured != predicted).sum()),
                             "pages_lost": float((~ok).mean()),
                             "pages_lost_predicted":
                                 float((owner[stored] == victim).mean()),
                             "wrong_values": wrong, "read_after_kill_s": round(read_s, 3),
                             "ring_hit_mean": blast_radius(workload, owner, n)["hit_mean"]})
        finally:
            for client in clients.values():
                client.close()
    return rows


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def render_ring(rows: list[dict[str, Any]], title: str) -> Table:
    t = Table(title=title)
    for col in ("N", "placement", "hit mean", "hit max", "hit expected", "lost mean",
                "lost max", "prefix lost mean", "prefix lost max", "servers/session",
                "load max/mean"):
        t.add_column(col, justify="left" if col == "placement" else "right")
    for r in rows:
        t.add_row(str(r["servers"]), r["placement"], _pct(r["hit_mean"]), _pct(r["hit_max"]),
                  "-" if r["hit_expected"] is None else _pct(r["hit_expected"]),
                  _pct(r["pages_lost_mean"]),
                  _pct(r["pages_lost_max"]), _pct(r["prefix_lost_mean"]),
                  _pct(r["prefix_lost_max"]), f"{r['servers_per_session']:.2f}",
                  f"{r['load_max_over_mean']:.2f}")
    return t


def render_real(rows: list[dict[str, Any]], title: str) -> Table:
    t = Table(title=title)
    for col in ("N", "placement", "killed", "hit", "hit predicted", "disagree",
                "ring hit mean", "lost", "lost predicted", "wrong values", "read s"):
        t.add_column(col, justify="left" if col == "placement" else "right")
    for r in rows:
        t.add_row(str(r["servers"]), r["placement"], f"#{r['killed_index']}", _pct(r["hit"]),
                  _pct(r["hit_predicted"]),
                  f"[red]{r['disagree']}[/]" if r["disagree"] else "0",
                  _pct(r["ring_hit_mean"]), _pct(r["pages_lost"]),
                  _pct(r["pages_lost_predicted"]),
                  f"[red]{r['wrong_values']}[/]" if r["wrong_values"] else "0",
                  f"{r['read_after_kill_s']:.2f}")
    return t


def _size(ctx: click.Context, param: click.Parameter, value: Any) -> int:
    try:
        return parse_size(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--ring", "ring_servers", multiple=True, type=click.IntRange(min=1),
              default=RING_SERVERS, show_default=True,
              help="Server counts computed with the ring code (repeatable).")
@click.option("--local", "local_servers", multiple=True, type=click.IntRange(min=2),
              help="Also run N real local servers, kill one, read back (repeatable).")
@click.option("--sessions", type=click.IntRange(min=1), default=5000, show_default=True,
              help="Sessions of the ring-code workload.")
@click.option("--local-sessions", type=click.IntRange(min=1), default=500, show_default=True,
              help="Sessions of the real-process workload.")
@click.option("--min-pages", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--max-pages", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--group-pages", multiple=True, type=click.IntRange(min=1), default=(64,),
              show_default=True, help="Pages per placement run of chain placement "
              "(repeatable; the plugin's group_pages, default 64).")
@click.option("--shared-pages", type=click.IntRange(min=0), default=0, show_default=True,
              help="Each chain starts with this many pages of a shared prompt.")
@click.option("--prompts", type=click.IntRange(min=1), default=1, show_default=True,
              help="Distinct shared prompts (with --shared-pages).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--page-bytes", default="4KiB", show_default=True, callback=_size,
              help="Value size of a page in the real-process run.")
@click.option("--memory", default="256MiB", show_default=True, callback=_size,
              help="Arena size per local server.")
@click.option("--slab-bytes", default="1MiB", show_default=True, callback=_size)
@click.option("--timeout-ms", type=click.IntRange(min=1), default=2000, show_default=True,
              help="Deadline of one call in the real-process run.")
@click.option("--log-dir", type=click.Path(file_okay=False),
              help="Write the local servers' logs here.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True),
              help="Write machine info, settings and every row to this file.")
@click.pass_context
def main(ctx: click.Context, ring_servers: tuple[int, ...], local_servers: tuple[int, ...],
         sessions: int, local_sessions: int, min_pages: int, max_pages: int,
         group_pages: tuple[int, ...], shared_pages: int, prompts: int, seed: int,
         page_bytes: int, memory: int,
         slab_bytes: int, timeout_ms: int, log_dir: str | None, json_path: str | None) -> None:
    """Fraction of sessions whose prefix chain loses a page when one of N servers dies,
    chain placement (group=) against key placement."""
    from gcache.bench.cli import machine_info

    if min_pages > max_pages:
        raise click.UsageError("--min-pages must be <= --max-pages")
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    placements = [KEY, *(Placement(g) for g in dict.fromkeys(group_pages))]
    out = Console()
    if not out.is_terminal:
        out = Console(width=max(out.width, 132))
    shape = f"{min_pages}..{max_pages} pages per chain, seed {seed}"
    if shared_pages:
        shape += f", first {shared_pages} pages from {prompts} shared prompt(s)"
    ring = ring_rows(make_workload(sessions, min_pages, max_pages, seed,
                                   shared_pages=shared_pages, prompts=prompts), placements,
                     list(dict.fromkeys(ring_servers)))
    out.print(render_ring(ring, f"blast radius, ring code: {sessions} sessions x {shape}"))
    real: list[dict[str, Any]] = []
    if local_servers:
        local = make_workload(local_sessions, min_pages, max_pages, seed,
                              shared_pages=shared_pages, prompts=prompts)
        for n in dict.fromkeys(local_servers):
            Console(stderr=True).print(f"{n} local servers: write, kill -9 one, read back")
            real += measure_real(n, local, placements, page_bytes=page_bytes, memory=memory,
                                 slab_bytes=slab_bytes, seed=seed, timeout_ms=timeout_ms,
                                 log_dir=log_dir)
        out.print(render_real(real, f"blast radius, real processes: {local_sessions} "
                              f"sessions x {shape}, {format_size(page_bytes)} pages"))
    if json_path:
        doc = {"machine": machine_info(), "command": " ".join(sys.argv),
               "settings": {"sessions": sessions, "local_sessions": local_sessions,
                            "min_pages": min_pages, "max_pages": max_pages,
                            "group_pages": list(group_pages), "shared_pages": shared_pages,
                            "prompts": prompts, "seed": seed,
                            "page_bytes": page_bytes, "memory": memory},
               "ring": ring, "real": real}
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    if any(r["disagree"] or r["wrong_values"] for r in real):
        Console(stderr=True).print("[red]real-process sessions hit differ from the ring "
                                   "code's prediction, or a read returned a wrong value[/]")
        ctx.exit(1)


if __name__ == "__main__":
    main()

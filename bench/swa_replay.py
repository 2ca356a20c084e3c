"""Replay a Mooncake trace as a hybrid-SWA engine: capacity and hit rate of the SWA layout.

    python -m gcache.bench.swa_replay TRACE.jsonl [--servers 3 --memory 384MiB] \\
        [--layers 70 --full-layers 10 --window-tokens 128] [--page-tokens 64] \\
        [--bytes-per-token-layer 6] [--limit N] [--json out.json]

Two layouts of the same model (MiMo-V2.5-Pro-like: 70 layers, 10 full
attention, 60 sliding-window layers with a 128-token window) are replayed, each
against a fresh real cluster of the same fixed capacity:

* ``swa``: what SGLang sends the gcache plugin (``gcache.sdk.sglang``): pool
  ``kv`` holds the full-attention layers of every page, pool ``swa`` holds the
  SWA layers of the trailing window only. A hit is the plugin's window-safe
  length: the largest p with KV ``[0, p)`` and SWA ``[p - W, p)`` stored
  (``window_safe_stops``, the same code ``batch_exists_v2`` runs).
* ``naive``: every layer of every page in one object; a hit is the stored
  prefix.

Each request does what an engine's L3 does: the hit query, reads of the hit
(KV prefix and the SWA window, checked against a value oracle), then writes of
what was missing. Where SWA windows come from: the engine offloads the window
that is resident when a request's prefill ends (its page-aligned end), and the
window at the end of its last full 512-token trace block. The trace names
prompts only by 512-token block ids, so a later turn that extends a
conversation shares exactly the earlier turn's full blocks; the second window
stands for the window SGLang keeps at the end of that earlier sequence (its
prompt plus output), which the block ids cannot express.

Reported per layout: token hit rate, the logical bytes the layout stores for the
whole trace (unique objects x size) against a store of all layers for every
token, bytes moved, and the servers' evictions and resident bytes. Object
sizes are scaled by ``--bytes-per-token-layer`` (6 keeps a full-trace replay
within minutes on a 2-core machine); ratios do not depend on it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from gcache.sdk.client import Client
from gcache.sdk.sglang import (
    ChainStore,
    HitPolicy,
    PluginConfig,
    PoolSpec,
    SidePool,
    chain_groups,
    leading,
    window_safe_stops,
)
from gcache.testing.cluster import Cluster
from gcache.testing.oracle import check_value, fill_value

BLOCK_TOKENS = 512  # tokens per Mooncake trace hash id


@dataclass(frozen=True)
class Geometry:
    layers: int = 70
    full_layers: int = 10
    window_tokens: int = 128
    page_tokens: int = 64
    bytes_per_token_layer: int = 6

    @property
    def window_pages(self) -> int:
        return math.ceil(self.window_tokens / self.page_tokens)

    def page_bytes(self, layers: int) -> int:
        return layers * self.page_tokens * self.bytes_per_token_layer


@dataclass
class Request:
    chain: list[str]        # page keys (one per page of page_tokens)
    block_end: int          # pages up to the end of the last full trace block


def requests(path: str, geo: Geometry, limit: int | None) -> Iterator[Request]:
    if BLOCK_TOKENS % geo.page_tokens:
        raise SystemExit(f"--page-tokens must divide {BLOCK_TOKENS}")
    per = BLOCK_TOKENS // geo.page_tokens
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                return
            if not line.strip():
                continue
            r = json.loads(line)
            ids = r["hash_ids"]
            n = min(int(r["input_length"]) // geo.page_tokens, len(ids) * per)
            chain = [f"{ids[p // per]:x}.{p % per}" for p in range(n)]
            yield Request(chain, min(n, (int(r["input_length"]) // BLOCK_TOKENS) * per))


@dataclass
class Report:
    layout: str
    requests: int = 0
    tokens: int = 0
    hit_tokens: int = 0
    prefix_tokens: int = 0        # stored-KV prefix, before the window rule (swa layout)
    lost_after_exists: int = 0
    wrong_values: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    unique: dict = field(default_factory=dict)   # pool -> set of page keys ever written
    seconds: float = 0.0
    servers: dict = field(default_factory=dict)

    def summary(self, geo: Geometry) -> dict:
        kv_pages = len(self.unique.get("kv", ()))
        swa_pages = len(self.unique.get("swa", ()))
        if self.layout == "swa":
            stored = kv_pages * geo.page_bytes(geo.full_layers) + \
                swa_pages * geo.page_bytes(geo.layers - geo.full_layers)
        else:
            stored = kv_pages * geo.page_bytes(geo.layers)
        full = kv_pages * geo.page_bytes(geo.layers)
        return {
            "layout": self.layout, "requests": self.requests, "tokens": self.tokens,
            "token_hit_rate": round(self.hit_tokens / self.tokens, 4) if self.tokens else 0.0,
            "stored_prefix_rate": round(self.prefix_tokens / self.tokens, 4)
            if self.tokens else 0.0,
            "unique_kv_pages": kv_pages, "unique_swa_pages": swa_pages,
            "logical_bytes_stored": stored, "all_layers_bytes": full,
            "capacity_ratio_vs_all_layers": round(full / stored, 3) if stored else 0.0,
            "bytes_written": self.bytes_written, "bytes_read": self.bytes_read,
            "wrong_values": self.wrong_values, "lost_after_exists": self.lost_after_exists,
            "seconds": round(self.seconds, 1), **self.servers,
        }


def pool_specs(layout: str, geo: Geometry) -> tuple[PoolSpec, PoolSpec | None]:
    """The pools a layout writes: ``swa``: KV (full-attention layers) and SWA (the
    sliding-window layers); ``naive``: every layer in KV, no SWA pool."""
    tag = f"bench.p{geo.page_tokens}.page_first.-.b{geo.bytes_per_token_layer}"
    if layout == "swa":
        return (PoolSpec("kv", tag, "tp0of1", (geo.page_bytes(geo.full_layers),)),
                PoolSpec("swa", tag, "tp0of1", (geo.page_bytes(geo.layers - geo.full_layers),)))
    return PoolSpec("kv", tag, "tp0of1", (geo.page_bytes(geo.layers),)), None


class Engine:
    """One layout's L3 path, shared by the replay threads."""

    def __init__(self, layout: str, client: Client, geo: Geometry, group_pages: int,
                 servers: list[str]) -> None:
        self.layout, self.geo = layout, geo
        cfg = PluginConfig(servers=tuple(servers), group_pages=group_pages, touch=False)
        self.store = ChainStore(client, cfg)
        self.kv, self.swa = pool_specs(layout, geo)
        self.rep = Report(layout, unique={"kv": set(), "swa": set()})
        self.lock = threading.Lock()

    def _bufs(self, spec: PoolSpec, n: int, cache: dict) -> list[list[np.ndarray]]:
        arrs = cache.setdefault(spec.name, [])
        while len(arrs) < n:
            arrs.append(np.empty(spec.page_bytes, np.uint8))
        return [[a] for a in arrs[:n]]

    def _check(self, spec: PoolSpec, keys: list[str], bufs: list[list[np.ndarray]]) -> int:
        return sum(not check_value(spec.keys(k)[0].encode(), b[0]) for k, b in zip(keys, bufs))

    def _write(self, spec: PoolSpec, keys: list[str], groups: list[str] | None,
               cache: dict, before: str | None = None) -> tuple[int, list[str]]:
        if not keys:
            return 0, []
        bufs = self._bufs(spec, len(keys), cache)
        for k, b in zip(keys, bufs):
            fill_value(spec.keys(k)[0].encode(), b[0])
        ok = self.store.put_pages(spec, keys, bufs, groups, before)
        return sum(ok) * spec.page_bytes, [k for k, o in zip(keys, ok) if o]

    def step(self, req: Request, cache: dict) -> None:
        geo, st = self.geo, self.store
        chain, n = req.chain, len(req.chain)
        if not n:  # shorter than one page: nothing to cache
            with self.lock:
                self.rep.requests += 1
            return
        groups = chain_groups([], chain, st.cfg.group_pages)
        w = geo.window_pages
        fut_kv = st.exists_async(self.kv, chain, groups)
        if self.swa is not None:
            fut_swa = st.exists_async(self.swa, chain, groups)
            kv_present = st.wait(fut_kv, n)
            swa_present = st.wait(fut_swa, n)
            hit, pools, _stops = window_safe_stops(
                kv_present, [SidePool("swa", HitPolicy.TRAILING_PAGES, swa_present, w)])
            prefix = pools["kv"]
        else:
            kv_present = st.wait(fut_kv, n)
            hit = prefix = leading(kv_present)
        wrong = lost = nread = 0
        if hit:
            bufs = self._bufs(self.kv, hit, cache)
            ok = st.get_pages(self.kv, chain[:hit], bufs, groups[:hit])
            good = leading(ok)
            wrong += self._check(self.kv, chain[:good], bufs[:good])
            nread += good * self.kv.page_bytes
            win_ok = True
            if self.swa is not None and good == hit:
                lo = max(0, hit - w)
                wb = [[np.empty(self.swa.page_bytes, np.uint8)] for _ in range(hit - lo)]
                wok = st.get_pages(self.swa, chain[lo:hit], wb, groups[lo:hit])
                win_ok = all(wok)
                if win_ok:
                    wrong += self._check(self.swa, chain[lo:hit], wb)
                    nread += (hit - lo) * self.swa.page_bytes
            if good < hit or not win_ok:
                # SGLang drops an incomplete SWA window; a shorter KV prefix has no window
                lost = hit
                hit = good if self.swa is None else 0
        written, kv_new = self._write(self.kv, chain[hit:], groups[hit:], cache,
                                      chain[hit - 1] if hit else "")
        swa_new: list[str] = []
        if self.swa is not None:
            want: list[int] = []
            for q in {n, req.block_end}:
                if q > 0:
                    want.extend(p for p in range(max(0, q - w), q) if p not in want)
            want.sort()
            wk = [chain[p] for p in want]
            b, swa_new = self._write(self.swa, wk, [groups[p] for p in want], cache)
            written += b
        with self.lock:
            r = self.rep
            r.requests += 1
            r.tokens += n * geo.page_tokens
            r.hit_tokens += hit * geo.page_tokens
            r.prefix_tokens += prefix * geo.page_tokens
            r.wrong_values += wrong
            r.lost_after_exists += lost
            r.bytes_read += nread
            r.bytes_written += written
            r.unique["kv"].update(kv_new)
            r.unique["swa"].update(swa_new)


def run_layout(layout: str, args: argparse.Namespace, geo: Geometry,
               extra: list[str] | None = None, log_dir: str | None = None) -> dict:
    """Replay ``layout`` through a fresh cluster (``extra``: more server flags, such as
    ``--eviction-policy``; ``log_dir``: the servers' logs)."""
    with Cluster(args.servers, args.memory, slab=args.slab_bytes, extra=extra,
                 log_dir=log_dir) as cl:
        with Client(servers=cl.addresses, namespace=f"swa-replay/{layout}",
                    timeout_ms=args.timeout_ms) as client:
            eng = Engine(layout, client, geo, args.group_pages, cl.addresses)
            it = requests(args.trace, geo, args.limit)
            lock = threading.Lock()
            t0 = time.perf_counter()

            def worker() -> None:
                cache: dict = {}
                while True:
                    with lock:
                        req = next(it, None)
                    if req is None:
                        return
                    eng.step(req, cache)
                    if args.progress and eng.rep.requests % 500 == 0:
                        print(f"  {layout}: {eng.rep.requests} requests, "
                              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)

            threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            eng.rep.seconds = time.perf_counter() - t0
            used = evictions = cap = 0
            for s in client.stats().values():
                flat = _flatten(s)
                used += int(flat.get("used_bytes", 0))
                cap += int(flat.get("capacity_bytes", 0))
                evictions += int(flat.get("evictions", 0))
            eng.rep.servers = {"capacity_bytes": cap, "resident_bytes": used,
                               "evictions": evictions}
            return eng.rep.summary(geo)


def _flatten(d: object, out: dict | None = None) -> dict:
    out = {} if out is None else out
    if isinstance(d, dict):
        for k, v in d.items():
            if isinstance(v, dict):
                _flatten(v, out)
            else:
                out.setdefault(k, v)
    return out


def unbounded_hit_rates(path: str, geo: Geometry, limit: int | None) -> dict:
    """Hit rates with infinite capacity (no eviction): the ceiling of each layout."""
    kv: set[str] = set()
    swa: set[str] = set()
    tot = prefix = safe = 0
    w = geo.window_pages
    for req in requests(path, geo, limit):
        c, n = req.chain, len(req.chain)
        tot += n
        k = leading([x in kv for x in c])
        prefix += k
        swa_side = SidePool("swa", HitPolicy.TRAILING_PAGES, [x in swa for x in c], w)
        h, _, _ = window_safe_stops([x in kv for x in c[:k]] + [False] * (n - k), [swa_side])
        safe += h
        kv.update(c)
        for q in {n, req.block_end}:
            if q > 0:
                swa.update(c[max(0, q - w):q])
    return {"prefix_hit_rate": round(prefix / tot, 4) if tot else 0.0,
            "window_safe_hit_rate": round(safe / tot, 4) if tot else 0.0,
            "unique_kv_pages": len(kv), "unique_swa_pages": len(swa)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gcache.bench.swa_replay",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="Mooncake FAST'25 JSONL trace (read in place)")
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--memory", default="384MiB", help="arena per server (fixed capacity)")
    ap.add_argument("--slab-bytes", default="1MiB")
    ap.add_argument("--layers", type=int, default=70)
    ap.add_argument("--full-layers", type=int, default=10)
    ap.add_argument("--window-tokens", type=int, default=128)
    ap.add_argument("--page-tokens", type=int, default=64)
    ap.add_argument("--bytes-per-token-layer", type=int, default=6)
    ap.add_argument("--group-pages", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--timeout-ms", type=int, default=5000)
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--layouts", default="swa,naive")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)
    geo = Geometry(args.layers, args.full_layers, args.window_tokens, args.page_tokens,
                   args.bytes_per_token_layer)
    out = {"trace": args.trace, "geometry": geo.__dict__,
           "cluster": {"servers": args.servers, "memory": args.memory},
           "unbounded": unbounded_hit_rates(args.trace, geo, args.limit), "layouts": {}}
    for layout in [x.strip() for x in args.layouts.split(",") if x.strip()]:
        if layout not in ("swa", "naive"):
            raise SystemExit(f"unknown layout {layout!r}: use swa and/or naive")
        out["layouts"][layout] = run_layout(layout, args, geo)
        print(json.dumps(out["layouts"][layout]), file=sys.stderr)
    lay = out["layouts"]
    if "swa" in lay and "naive" in lay:
        out["swa_vs_naive"] = {
            "capacity_ratio": lay["swa"]["capacity_ratio_vs_all_layers"],
            "hit_rate_swa": lay["swa"]["token_hit_rate"],
            "hit_rate_naive": lay["naive"]["token_hit_rate"],
        }
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

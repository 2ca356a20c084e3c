"""Handoff benchmark: drain a server holding ``--total`` bytes and time its handoff.

``python -m gcache.bench.handoff --total 1GiB --size 1MiB`` starts 3 masters and 2
servers, puts ``--total`` bytes of keys that the first server owns (timing the SDK's
batch put of them, the same run's reference), drains the first server and reports the
handoff's rate from its own log (a pass's start line to its done line), its objects and
bytes moved, and whether the drained server ended empty. ``--migrate-mbps`` passes the
cap to the servers.

``--join`` times a join instead: one server holds ``--total`` bytes of keys that a second
server will own once it joins (chosen with the real ring code before it starts), the
second server starts, and the first hands them over (the join handoff, on by default);
it reports the same figures, the wall time from the newcomer's start-up line to the
first server's report of every object moved.

``--foreground`` also measures what the handoff costs foreground IO: a second client
batch-gets ``--fg-batch`` values of ``--fg-size`` that the *other* server owns (the
handoff's target, whose memory and connections the handoff shares) back to back, for
``--quiet-s`` seconds before the drain and again after it (quiet) and while the drain
runs, and reports both p50/p99 and their ratio, measured in the same run.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import pathlib
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator

import click

from gcache.config import parse_size
from gcache.discovery import MasterClient
from gcache.ring import Member, Ring
from gcache.sdk import Client, Status
from gcache.sdk.routing import placement_hashes
from gcache.testing.cluster import Cluster
from gcache.testing.oracle import value_for
from gcache.testing.waiting import wait_for

_PASS = re.compile(r"^(\S+ \S+) INFO +gcache\.server\.handoff: handoff pass at epoch (\d+)"
                   r"(?:: (\d+) objects \((\d+) bytes\)| (copied|done): (\d+) moved)", re.M)


def pass_rates(log: str) -> list[dict]:
    """The handoff passes a server's text log records: epoch, objects, bytes, the seconds
    until every put was answered (``gb_per_s``: the handoff's rate) and until the pass
    ended (``pass_seconds``: that plus the grace before the old copies are deleted)."""
    starts: dict[str, tuple[float, int, int]] = {}
    copied: dict[str, float] = {}
    out = []
    for m in _PASS.finditer(log):
        t = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if m[3] is not None:
            starts[m[2]] = (t, int(m[3]), int(m[4]))
        elif m[5] == "copied":
            copied[m[2]] = t
        elif m[2] in starts:
            t0, n, b = starts.pop(m[2])
            t1 = copied.pop(m[2], t)
            out.append({"epoch": int(m[2]), "objects": n, "bytes": b, "moved": int(m[6]),
                        "seconds": round(t1 - t0, 3), "gb_per_s": round(b / (t1 - t0) / 1e9, 3),
                        "pass_seconds": round(t - t0, 3)})
    return out


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


class Foreground:
    """Batch gets back to back on its own client, into buffers it keeps (as an engine
    loads into its own memory); ``window`` collects latencies (s)."""

    def __init__(self, client: Client, keys: list[bytes], values: dict[bytes, bytes]) -> None:
        self.client, self.keys, self.values = client, keys, values
        self.bufs = [bytearray(len(values[k])) for k in keys]
        self.lat: list[float] = []
        self.wrong = self.misses = 0

    def window(self, until) -> list[float]:
        """Run until ``until()`` is true; the latencies of that window."""
        self.lat = []
        while not until():
            t = time.perf_counter()
            got = self.client.get_batch_into(self.keys, self.bufs)
            self.lat.append(time.perf_counter() - t)
            for k, st, b in zip(self.keys, got, self.bufs):
                if st != Status.OK:
                    self.misses += 1
                elif b != self.values[k]:
                    self.wrong += 1
        return self.lat


def put_timed(c: Client, keys: list[bytes], vsize: int) -> float:
    """Put every key (its oracle value) in 64 MiB batches; the seconds the puts took."""
    per, put_s = max(1, (64 << 20) // vsize), 0.0
    for i in range(0, len(keys), per):  # every value must stay: checked by the caller
        ks = keys[i:i + per]
        vs = [value_for(k, vsize) for k in ks]
        t = time.perf_counter()
        if c.put_batch(ks, vs) != [Status.OK] * len(ks):
            raise SystemExit("a put failed: give the servers more memory")
        put_s += time.perf_counter() - t
    return put_s


@contextlib.contextmanager
def bench_cluster(servers: int, nbytes: int, migrate_mbps: str
                  ) -> Iterator[tuple[Cluster, str]]:
    """3 masters and ``servers`` servers with room for ``nbytes`` each (16 MiB slabs:
    little rounding), logging to a new directory; yields (the running cluster, the
    directory). The directory goes with a run that succeeds, and is kept, and named on
    stderr, after one that fails."""
    memory = f"{(int(nbytes * 1.3) >> 20) + 64}MiB"
    logs = tempfile.mkdtemp(prefix="gcache-bench-handoff-")
    try:
        with Cluster(servers, memory, slab="16MiB", masters=3, token="bench", log_dir=logs,
                     server_extra=["--migrate-mbps", migrate_mbps]) as cl:
            yield cl, logs
    except BaseException:
        click.echo(f"gcache.bench.handoff: the cluster's logs are kept in {logs}", err=True)
        raise
    shutil.rmtree(logs, ignore_errors=True)


def masters_up(cl: Cluster, servers: int) -> MasterClient:
    """The masters' client, once they list ``servers`` members up."""
    mc = MasterClient(cl.master_addresses, "bench")
    wait_for(lambda: sum(m["state"] == "up" for m in mc.view()["members"]) == servers, 30)
    return mc


def run_join(nbytes: int, vsize: int, migrate_mbps: str) -> dict:
    """One server holds ``nbytes`` of keys a newcomer will own; time their handoff."""
    n = nbytes // vsize
    with bench_cluster(1, nbytes, migrate_mbps) as (cl, logs):
        mc = masters_up(cl, 1)
        first = cl.servers[0]
        new_name = first.name.rsplit("-", 1)[0] + "-new"
        # the ring once the newcomer (same capacity, so the same weight) is in
        future = Ring([Member(first.name, first.address), Member(new_name, "newcomer")])
        with Client(masters=cl.master_addresses, token="bench", timeout_ms=30_000,
                    transport="tcp") as c:
            cand = [f"j{i}".encode() for i in range(4 * n)]
            owners = future.owners(placement_hashes(c.namespace, cand))
            keys = [k for k, m in zip(cand, owners) if m.id == new_name][:n]
            put_s = put_timed(c, keys, vsize)
            if c.stats()[first.address]["evictions"]:
                raise SystemExit("the first server evicted: give it more memory")

        def handed_over() -> dict | None:
            rows = {m["id"]: m for m in mc.status()["members"]}
            st = (rows.get(first.name) or {}).get("stats") or {}
            new = rows.get(new_name) or {}
            done = (new.get("state") == "up" and not st.get("handoff_active", 1)
                    and st.get("handoff_objects_moved", 0) >= len(keys))
            return st if done else None

        cl.add_server(new_name)  # returns at its start-up line: registered, serving
        t0 = time.perf_counter()
        st = wait_for(handed_over, 600)
        wall = time.perf_counter() - t0
        passes = pass_rates(open(f"{logs}/{first.name}.log").read())
    held = len(keys) * vsize
    return {"join": True, "total_bytes": held, "value_bytes": vsize, "objects": len(keys),
            "migrate_mbps": float(migrate_mbps),
            "sdk_batch_put_gb_per_s": round(held / put_s / 1e9, 3),
            "join_wall_s (newcomer serving to all moved, 200 ms heartbeats)": round(wall, 2),
            "handoff_objects_moved": st["handoff_objects_moved"],
            "handoff_bytes_moved": st["handoff_bytes_moved"],
            "handoff_lost": st["handoff_lost"], "passes": passes}


@click.command()
@click.option("--total", default="1GiB", show_default=True, help="Bytes the drained server holds.")
@click.option("--size", default="1MiB", show_default=True, help="Value size.")
@click.option("--migrate-mbps", default="0", show_default=True, help="The servers' cap (MB/s).")
@click.option("--join", "join", is_flag=True,
              help="Time a join (the newcomer takes --total) instead of a drain.")
@click.option("--foreground", is_flag=True,
              help="Also time foreground batch gets quiet vs during the drain.")
@click.option("--fg-size", default="64KiB", show_default=True, help="Foreground value size.")
@click.option("--fg-batch", default=16, show_default=True, help="Foreground keys per get.")
@click.option("--quiet-s", default=3.0, show_default=True,
              help="Seconds of quiet foreground gets before the drain.")
@click.option("--json", "json_out", default=None, help="Also write the result here.")
def main(total: str, size: str, migrate_mbps: str, join: bool, foreground: bool,
         fg_size: str, fg_batch: int, quiet_s: float, json_out: str | None) -> None:
    nbytes, vsize = parse_size(total), parse_size(size)
    if join:
        if foreground:
            raise click.UsageError("--foreground goes with a drain, not --join")
        return emit(run_join(nbytes, vsize, migrate_mbps), json_out)
    n = nbytes // vsize
    with bench_cluster(2, nbytes, migrate_mbps) as (cl, logs):
        mc = masters_up(cl, 2)
        first = cl.servers[0]
        with Client(masters=cl.master_addresses, token="bench", timeout_ms=30_000,
                    transport="tcp") as c:
            cand = [f"h{i}".encode() for i in range(4 * n)]
            keys = [k for k, a in zip(cand, c.owners(cand)) if a == first.address][:n]
            put_s = put_timed(c, keys, vsize)
            if c.stats()[first.address]["evictions"]:
                raise SystemExit("the first server evicted: give it more memory")
            fg = None
            if foreground:
                other = cl.servers[1].address
                fcand = [f"fg{i}".encode() for i in range(8 * fg_batch)]
                fkeys = [k for k, a in zip(fcand, c.owners(fcand)) if a == other][:fg_batch]
                fvals = {k: value_for(k, parse_size(fg_size)) for k in fkeys}
                if c.put_batch(fkeys, list(fvals.values())) != [Status.OK] * len(fkeys):
                    raise SystemExit("a foreground put failed")
        fc = (Client(masters=cl.master_addresses, token="bench", timeout_ms=5_000,
                     transport="tcp") if foreground else None)
        if fc is not None:
            fg = Foreground(fc, fkeys, fvals)
            end = time.perf_counter() + quiet_s
            quiet = list(fg.window(lambda: time.perf_counter() > end))
        t0 = time.perf_counter()
        # the drain's epoch as the leader applied it: a follower's /view may still be at
        # the epoch before, and an empty server's finished pass there read as drained
        epoch = mc.admin("drain", first.name)["epoch"]

        def drained() -> dict | None:
            m = next(m for m in mc.status()["members"] if m["id"] == first.name)
            st = m.get("stats") or {}
            done = (m["state"] == "draining" and st.get("objects", 1) == 0
                    and not st.get("handoff_active", 1) and st.get("handoff_epoch", -1) >= epoch)
            # a heartbeat from before the drain (empty server, a finished pass) must not count
            return st if done else None

        if fg is not None:
            box: list = []
            box_done = threading.Event()
            fg_thread = threading.Thread(target=lambda: box.append(fg.window(box_done.is_set)),
                                         daemon=True)
            fg_thread.start()
        st = wait_for(drained, 600)
        wall = time.perf_counter() - t0
        if fg is not None:
            box_done.set()
            fg_thread.join(30)
            during = box[0] if box else []
            end = time.perf_counter() + quiet_s  # quiet again: noise hits both sides
            quiet += fg.window(lambda: time.perf_counter() > end)
            fc.close()
        passes = pass_rates(open(f"{logs}/{first.name}.log").read())
    held = len(keys) * vsize
    res = {"total_bytes": held, "value_bytes": vsize, "objects": len(keys),
           "migrate_mbps": float(migrate_mbps),
           "sdk_batch_put_gb_per_s": round(held / put_s / 1e9, 3),
           "drain_wall_s (admin to empty, 200 ms heartbeats)": round(wall, 2),
           "handoff_objects_moved": st["handoff_objects_moved"],
           "handoff_bytes_moved": st["handoff_bytes_moved"], "handoff_lost": st["handoff_lost"],
           "passes": passes}
    if fg is not None:
        ms = 1e3
        res["foreground"] = {
            "batch": f"{fg_batch} x {fg_size}",
            "quiet": {"gets": len(quiet), "p50_ms": round(percentile(quiet, .5) * ms, 3),
                      "p99_ms": round(percentile(quiet, .99) * ms, 3)},
            "during_drain": {"gets": len(during),
                             "p50_ms": round(percentile(during, .5) * ms, 3),
                             "p99_ms": round(percentile(during, .99) * ms, 3)},
            "p99_ratio": round(percentile(during, .99) / percentile(quiet, .99), 2),
            "wrong": fg.wrong, "misses": fg.misses}
    emit(res, json_out)


def emit(res: dict, json_out: str | None) -> None:
    text = json.dumps(res, indent=2)
    click.echo(text)
    if json_out:
        pathlib.Path(json_out).write_text(text)


if __name__ == "__main__":
    main()

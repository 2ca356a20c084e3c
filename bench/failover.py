"""Master failover benchmark: leader kill -9 under IO load.

``python -m gcache.bench.failover --kills 5`` starts 3 masters and 2 servers,
drives put+get batches through ``Client(masters=...)`` from a background
thread, measures a quiet baseline, then kills the Raft leader with SIGKILL
``--kills`` times (restarting it after each). For every kill it reports the
time until another master answers as leader and the IO throughput in the
``--window`` seconds after the kill, next to the quiet baseline of the same
run. IO never goes through the masters, so the two should match.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time

import click
import numpy as np

from gcache.discovery import MasterClient
from gcache.sdk import Client, Status
from gcache.testing.cluster import Cluster


class Load:
    """put_batch + get_batch_into of 16 x 64 KiB in a loop; counts bytes per second."""

    def __init__(self, masters: list[str]) -> None:
        self.client = Client(masters=masters, timeout_ms=2000, namespace="failover")
        self.keys = [f"f{i}".encode() for i in range(16)]
        self.bufs = [np.full(65536, i, np.uint8) for i in range(16)]
        self.out = [np.empty(65536, np.uint8) for _ in range(16)]
        self.events: list[tuple[float, int, int]] = []  # (t, bytes, failures)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            st = self.client.put_batch_from(self.keys, self.bufs)
            st += self.client.get_batch_into(self.keys, self.out)
            ok = sum(s == Status.OK for s in st)
            self.events.append((time.monotonic(), ok * 65536, len(st) - ok))

    def gbps(self, t0: float, t1: float) -> tuple[float, int]:
        sel = [(b, f) for t, b, f in self.events if t0 <= t < t1]
        return sum(b for b, _ in sel) / 1e9 / (t1 - t0), sum(f for _, f in sel)


def leader_of(addrs: list[str]) -> str | None:
    for a in addrs:
        try:
            h = MasterClient([a], timeout_s=0.3).request("GET", "/healthz", retry_s=0)
            if h.get("is_leader"):
                return a
        except Exception:
            continue
    return None


@click.command()
@click.option("--kills", default=5, show_default=True)
@click.option("--window", default=2.0, show_default=True, help="Seconds of IO measured per kill.")
@click.option("--baseline", default=3.0, show_default=True, help="Quiet seconds measured first.")
@click.option("--json", "json_out", default=None)
def main(kills: int, window: float, baseline: float, json_out: str | None) -> None:
    logs = tempfile.mkdtemp(prefix="gcache-failover-")
    with Cluster(2, "256MiB", slab="4MiB", masters=3, log_dir=logs) as cl:
        mc = MasterClient(cl.master_addresses)
        end = time.monotonic() + 20
        while time.monotonic() < end and sum(m["state"] == "up"
                                             for m in mc.view()["members"]) < 2:
            time.sleep(0.1)
        load = Load(cl.master_addresses)
        load.thread.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        time.sleep(baseline)
        quiet, quiet_fail = load.gbps(t0, time.monotonic())
        rows = []
        for k in range(kills):
            lead = None
            while lead is None:
                lead = leader_of(cl.master_addresses)
            idx = cl.master_addresses.index(lead)
            others = [a for a in cl.master_addresses if a != lead]
            t_kill = time.monotonic()
            cl.masters[idx].kill9()
            new = None
            while new is None and time.monotonic() - t_kill < 30:
                new = leader_of(others)
            elected = time.monotonic() - t_kill
            time.sleep(max(0.0, window - elected))
            during, fails = load.gbps(t_kill, t_kill + window)
            rows.append({"kill": k + 1, "old_leader": lead, "new_leader": new,
                         "failover_s": round(elected, 3), "io_gbps": round(during, 3),
                         "io_failures": fails})
            click.echo(f"kill {k + 1}: new leader in {elected:.3f}s, IO {during:.2f} GB/s "
                       f"(quiet {quiet:.2f}), failures {fails}")
            cl.masters[idx].start()
            time.sleep(1.0)
        load.stop.set()
        load.thread.join(10)
        load.client.close()
    fo = [r["failover_s"] for r in rows]
    res = {"quiet_gbps": round(quiet, 3), "quiet_failures": quiet_fail, "kills": rows,
           "failover_median_s": round(statistics.median(fo), 3), "failover_max_s": max(fo),
           "io_during_failover_vs_quiet": round(
               statistics.median(r["io_gbps"] for r in rows) / quiet, 3) if quiet else None}
    click.echo(json.dumps({k: v for k, v in res.items() if k != "kills"}, indent=2))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()

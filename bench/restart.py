"""Restart-time benchmark: fill an arena with small objects, stop, time the restart.

``python -m gcache.bench.restart --memory 16GiB --size 64KiB`` fills one
server to ``--fill`` of its capacity, stops it (SIGTERM, or SIGKILL with
``--kill9``), starts it again under the same name and reports the seconds
from spawn until it serves a verified get, plus the server's own recovery
figures from its log.
"""

from __future__ import annotations

import json
import re
import tempfile
import time

import click
import numpy as np

from gcache.config import parse_size
from gcache.sdk import Client, Status
from gcache.testing.cluster import Cluster
from gcache.testing.oracle import check_value, fill_value


@click.command()
@click.option("--memory", default="16GiB", show_default=True)
@click.option("--size", default="64KiB", show_default=True)
@click.option("--fill", default=0.85, show_default=True, help="Fraction of capacity to fill.")
@click.option("--kill9", is_flag=True, help="SIGKILL instead of a clean stop.")
@click.option("--json", "json_out", default=None)
def main(memory: str, size: str, fill: float, kill9: bool, json_out: str | None) -> None:
    nbytes = parse_size(size)
    logs = tempfile.mkdtemp(prefix="gcache-restart-")
    with Cluster(1, memory, slab="16MiB", log_dir=logs, prefix="restartbench",
                 ready_timeout=600) as cl:
        srv = cl.servers[0]
        n = int(parse_size(memory) * fill) // (nbytes + 4096)
        keys = [b"r%09d" % i for i in range(n)]
        batch = 256
        bufs = [np.empty(nbytes, np.uint8) for _ in range(batch)]
        t0 = time.perf_counter()
        with Client(cl.addresses, timeout_ms=30_000) as c:
            for s in range(0, n, batch):
                ks = keys[s:s + batch]
                for k, b in zip(ks, bufs):
                    fill_value(k, b)
                st = c.put_batch_from(ks, bufs[:len(ks)])
                if any(x != Status.OK for x in st):
                    raise SystemExit(f"fill failed at {s}: {set(st)}")
        fill_s = time.perf_counter() - t0
        if kill9:
            srv.kill9()
        else:
            srv.terminate()
        t0 = time.perf_counter()
        srv.start(timeout=300)
        listen_s = time.perf_counter() - t0
        with Client(cl.addresses, timeout_ms=30_000) as c:
            out = np.empty(nbytes, np.uint8)
            probe = [keys[0], keys[n // 2], keys[-1]]
            for k in probe:
                if c.get_batch_into([k], [out]) != [Status.OK] or not check_value(k, out):
                    raise SystemExit(f"object {k!r} missing or wrong after restart")
            serving_s = time.perf_counter() - t0
            stats = c.stats()[srv.address]
        log = open(f"{logs}/{srv.name}.log").read()
        rec = re.findall(r"arena ready .*? seconds=([0-9.e-]+)", log)
    res = {"memory": memory, "size": size, "objects": n, "fill_seconds": round(fill_s, 1),
           "stop": "kill -9" if kill9 else "clean", "restart_to_listen_s": round(listen_s, 2),
           "restart_to_verified_get_s": round(serving_s, 2),
           "recovery_scan_s": round(float(rec[-1]), 2) if rec else None,
           "recovered": stats["recovered"], "corrupt_dropped": stats["corrupt_dropped"]}
    click.echo(json.dumps(res, indent=2))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()

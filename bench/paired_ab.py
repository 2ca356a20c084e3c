"""Paired, interleaved A/B of batch gets or puts between two installed trees (a driver).

Why. The NVMe tier's speed on a shared VM drifts by tens of percent from one minute to
the next (the raw pread baseline read 0.52-1.58 GB/s within an hour), so two runs one
after the other compare the device's moods, not the code. Here each tree runs in its
own worker process (its own interpreter, so its own installed ``gcache``) with its own
one-server cluster and disk directory on the same device, both filled and settled up
front; the driver then alternates short timed windows between them (A then B, then B
then A, ...), so any drift lands on both sides of each pair. Each window reports GB/s;
the result is the per-round ratio B/A (median and how many rounds B was ahead). Run it
both ways round (``--a X --b Y``, then ``--a Y --b X``): the slot itself can be biased
(4-15 % on the test VM, in either direction from one run to the next), and the code's
ratio is the geometric mean of B/A with the new tree in B and A/B with it in A.

    python -m gcache.bench.paired_ab --a /tmp/basevenv/bin/python \\
        --b /tmp/newvenv/bin/python --rounds 30 --window 1.5

Each worker: ``Cluster(1, memory)`` with a disk tier (``--tier disk``: promotion off, as
``gcache-bench --tier disk``) or without, ``--keys`` values of ``--size`` put over tcp,
then ``get_batch_into`` (``--op put``: ``put_batch_from``, replacing them) of
consecutive ``--batch``-key groups (the bench's order) over ``--transport``, checking
every status. Not part of ``gcache-bench``: a tool for A/B
runs (bench/RESULTS.md cites its output).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from gcache.config import parse_size


def _worker(args: argparse.Namespace) -> None:
    import numpy as np

    from gcache.sdk import Client, Status
    from gcache.testing.cluster import Cluster

    size, n, batch = parse_size(args.size), args.keys, args.batch
    parent = tempfile.mkdtemp(prefix="gcache-paired-", dir="/var/tmp")
    extra = (["--disk-dir", parent, "--disk", args.disk, "--promote-policy", "never"]
             + (["--segment-bytes", args.segment_bytes] if args.segment_bytes else [])
             if args.tier == "disk" else [])
    cl = Cluster(1, args.memory, slab=args.slab, prefix=f"paired{os.getpid()}", extra=extra)
    try:
        cl.start()
        keys = [b"paired/%d" % i for i in range(n)]
        value = os.urandom(size)
        with Client(cl.addresses, timeout_ms=60_000, transport="tcp") as c:
            todo = keys
            for _ in range(5):  # a put that outran the mover evicted: put what is gone again
                for s in range(0, len(todo), 16):  # small calls: puts in flight stay put
                    ks = todo[s:s + 16]
                    assert c.put_batch(ks, [value] * len(ks)) == [Status.OK] * len(ks)
                todo = [k for s in range(0, n, 1024) for k, there in
                        zip(keys[s:s + 1024], c.exists_batch(keys[s:s + 1024])) if not there]
                if not todo:
                    break
            else:
                raise SystemExit(f"{len(todo)} of {n} keys still evicted after 5 fills")
            last = None
            while True:  # settled: the mover has stopped demoting
                st = next(iter(c.stats().values()))
                now = (st.get("disk_objects", 0), st.get("demoted", 0), st["objects"])
                if now == last:
                    break
                last = now
                time.sleep(1.0)
        with Client(cl.addresses, timeout_ms=60_000, transport=args.transport) as c:
            if args.op == "put":  # sources: each key's own bytes, rewritten every round
                bufs = list(np.frombuffer(os.urandom(batch * size), dtype=np.uint8)
                            .reshape(batch, size))
            else:
                bufs = list(np.zeros((batch, size), dtype=np.uint8))
            call = c.put_batch_from if args.op == "put" else c.get_batch_into
            groups, g = max(1, n // batch), 0
            print(json.dumps({"ready": True, "objects": st["objects"],
                              "disk_objects": st.get("disk_objects", 0)}), flush=True)
            for line in sys.stdin:
                cmd = line.split()
                if not cmd or cmd[0] != "go":
                    break
                lat: list[float] = []
                t0 = time.perf_counter()
                end = t0 + float(cmd[1])
                while time.perf_counter() < end:
                    ks = keys[g * batch:(g + 1) * batch]
                    g = (g + 1) % groups
                    t = time.perf_counter()
                    got = call(ks, bufs[:len(ks)])
                    lat.append(time.perf_counter() - t)
                    if got != [Status.OK] * len(ks):
                        raise SystemExit(f"{args.op} failed: {[Status(s).name for s in got]}")
                el = time.perf_counter() - t0
                print(json.dumps({"gbps": len(lat) * batch * size / el / 1e9,
                                  "p50_us": statistics.median(lat) * 1e6}), flush=True)
    finally:
        cl.close()
        shutil.rmtree(parent, True)


def _read(proc: subprocess.Popen, who: str, deadline: float) -> dict:
    """The worker's next JSON line (it writes nothing else on stdout, one whole line per
    command, so nothing waits in the pipe's buffer past the line read), by ``deadline``:
    a worker that hangs ends the run instead of holding it."""
    left = deadline - time.monotonic()
    line = ""
    if left > 0 and select.select([proc.stdout], [], [], left)[0]:
        line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"worker {who} ended or gave no answer in time (exit "
                         f"{proc.poll()})")
    return json.loads(line)


def run(args: argparse.Namespace) -> dict:
    # the workers run this file (the same measuring code on both sides; the tree under
    # test is whichever ``gcache`` each interpreter imports)
    me = [os.path.abspath(__file__)]
    fwd = ["--keys", str(args.keys), "--size", args.size, "--batch", str(args.batch),
           "--memory", args.memory, "--slab", args.slab, "--disk", args.disk,
           "--segment-bytes", args.segment_bytes,
           "--tier", args.tier, "--transport", args.transport, "--op", args.op]
    procs = {}
    try:
        for who, py in (("a", args.a), ("b", args.b)):
            procs[who] = subprocess.Popen([py, *me, "--worker", *fwd], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, cwd="/tmp")
        deadline = time.monotonic() + args.setup_timeout
        setup = {who: _read(p, who, deadline) for who, p in procs.items()}
        res: dict[str, list[dict]] = {"a": [], "b": []}
        for r in range(args.rounds):
            for who in (("a", "b") if r % 2 == 0 else ("b", "a")):
                procs[who].stdin.write(f"go {args.window}\n")
                procs[who].stdin.flush()
                res[who].append(_read(procs[who], who, time.monotonic() + 60 + args.window))
    finally:
        for p in procs.values():
            try:
                p.stdin.write("quit\n")
                p.stdin.close()
            except OSError:
                pass
        for p in procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    ratios = [b["gbps"] / a["gbps"] for a, b in zip(res["a"], res["b"])]
    out = {"a": args.a, "b": args.b, "setup": setup, "rounds": args.rounds,
           "window_s": args.window, "ratios_b_over_a": [round(x, 3) for x in ratios],
           "median_ratio": statistics.median(ratios),
           "b_ahead": sum(x > 1 for x in ratios)}
    for who in ("a", "b"):
        g = [x["gbps"] for x in res[who]]
        out[who + "_gbps_median"] = statistics.median(g)
        out[who + "_p50_us_median"] = statistics.median(x["p50_us"] for x in res[who])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default=sys.executable, help="python of tree A (the baseline)")
    ap.add_argument("--b", default=sys.executable, help="python of tree B")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--window", type=float, default=1.5, help="seconds per timed window")
    ap.add_argument("--keys", type=int, default=8192)
    ap.add_argument("--size", default="64KiB")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--memory", default="128MiB")
    ap.add_argument("--slab", default="16MiB")
    ap.add_argument("--disk", default="2GiB")
    ap.add_argument("--segment-bytes", default="", help="the servers' default if empty")
    ap.add_argument("--tier", choices=["disk", "memory"], default="disk")
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--op", choices=["get", "put"], default="get",
                    help="put: batch puts that replace the filled keys (put_batch_from)")
    ap.add_argument("--setup-timeout", type=float, default=600.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    out = run(args)
    print(json.dumps(out))
    print(f"B/A per round: median {out['median_ratio']:.3f}, B ahead {out['b_ahead']}/"
          f"{args.rounds}; A {out['a_gbps_median']:.3f} GB/s, B {out['b_gbps_median']:.3f} "
          f"GB/s (medians)", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Usable arena capacity under mixed value sizes (slab calcification, issue 14).

    gcache-bench capacity                          # uniform, bimodal, spread; 512 MiB
    gcache-bench capacity --memory 512MiB --workload spread --json out.json
    python -m gcache.bench.capacity ...            # the same command

One real server per workload (``--memory`` arena, ``--slab-bytes`` pages). Each run puts
values in random order and reads every one straight back (checked against the value
oracle), at three fills, each on a fresh arena:

* ``fill 45%`` / ``fill 90%``: values totalling that fraction of the arena; reported as
  the misses on the immediate read-back (a sound allocator has none at 45 %, and at 90 %
  only what the eviction policy chose).
* ``usable``: values totalling 1.5x the arena (so eviction runs); the bytes of the values
  still readable afterwards, as a fraction of the arena: what the arena can really hold.

``--churn`` (in-process, no server: ``churn``): small values (1..64 KiB) replaced at
random until the free space is split into small holes, then 1 MiB and 3 MiB puts;
reports the bytes each large put evicted, per byte put, and the arena fraction in use
after: what fragmentation costs.

Workloads (``sizes``, seeded): ``uniform`` 256 KiB values (one KV page size);
``bimodal`` KV + SWA pages, 384 KiB and 64 KiB (6x apart), half and half by count;
``spread`` uniform random sizes in [1 KiB, 3 MiB].
"""

from __future__ import annotations

import json
import os
import random
import tempfile

import click

from gcache.config import format_size, parse_size
from gcache.sdk import Client, Status
from gcache.testing.cluster import Cluster
from gcache.testing.oracle import check_value, value_for

WORKLOADS = ("uniform", "bimodal", "spread")


def sizes(workload: str, total: int, seed: int) -> list[int]:
    """Value sizes of ``workload`` summing to about ``total`` bytes (seeded)."""
    rng = random.Random(seed)
    out: list[int] = []
    acc = 0
    while acc < total:
        if workload == "uniform":
            n = 256 << 10
        elif workload == "bimodal":
            n = (384 << 10) if rng.random() < 0.5 else (64 << 10)
        elif workload == "spread":
            n = rng.randint(1 << 10, 3 << 20)
        else:
            raise click.BadParameter(f"unknown workload {workload!r}; one of {WORKLOADS}")
        n = min(n, total - acc) if acc + n > total and out else n
        out.append(n)
        acc += n
    return out


def fill_and_read(addresses: list[str], lens: list[int], tag: str,
                  timeout_ms: int = 20_000) -> dict[str, int]:
    """Put one value per size, then read each back: puts refused, misses, bytes read."""
    keys = [b"%s/%d" % (tag.encode(), i) for i in range(len(lens))]
    refused = missed = wrong = got_bytes = 0
    with Client(addresses, timeout_ms=timeout_ms) as c:
        for i in range(0, len(keys), 16):
            ks = keys[i:i + 16]
            sts = c.put_batch(ks, [value_for(k, n) for k, n in zip(ks, lens[i:i + 16])])
            refused += sum(s != Status.OK for s in sts)
        for i in range(0, len(keys), 16):
            ks = keys[i:i + 16]
            for k, n, v in zip(ks, lens[i:i + 16], c.get_batch(ks)):
                if v is None:
                    missed += 1
                elif len(v) != n or not check_value(k, v):
                    wrong += 1
                else:
                    got_bytes += n
    return {"values": len(keys), "bytes": sum(lens), "refused": refused, "missed": missed,
            "wrong": wrong, "resident_bytes": got_bytes}


def run(workload: str, memory: int, slab_bytes: int, seed: int) -> dict:
    """The three fills of one workload, each on a fresh one-server cluster."""
    out: dict = {"workload": workload, "memory": memory, "slab_bytes": slab_bytes}
    for name, frac in (("fill45", 0.45), ("fill90", 0.90), ("usable", 1.5)):
        lens = sizes(workload, int(memory * frac), seed)
        with Cluster(1, format_size(memory), slab=format_size(slab_bytes)) as cl:
            r = fill_and_read(cl.addresses, lens, f"{workload}-{name}")
        r["resident_fraction"] = round(r["resident_bytes"] / memory, 3)
        out[name] = r
    return out


def churn(memory: int, slab_bytes: int, seed: int) -> dict:
    """Small-value churn, then large puts, on an in-process MemoryTier (see above)."""
    from gcache.server.arena import Arena
    from gcache.server.memory_tier import MemoryTier

    rng = random.Random(seed)
    out: dict = {"memory": memory, "slab_bytes": slab_bytes}
    with tempfile.TemporaryDirectory(prefix="gcache-capacity-") as d:
        m = MemoryTier(Arena(os.path.join(d, "a.arena"), memory, slab_bytes, prefault=False))
        try:
            keys = 2 * m.capacity // (32 << 10)  # twice what fits: eviction runs
            for _ in range(5 * keys):
                _put(m, b"s%d" % rng.randrange(keys), rng.randint(1 << 10, 64 << 10))
            for big in (1 << 20, 3 << 20):
                before = m.stats()["evicted_bytes"]
                for i in range(20):
                    _put(m, b"big%d-%d" % (big, i), big)
                out[f"evicted_per_byte_{big >> 20}MiB"] = round(
                    (m.stats()["evicted_bytes"] - before) / (20 * big), 2)
            s = m.stats()
            out["used_fraction"] = round(s["used_bytes"] / s["capacity_bytes"], 3)
            out.update({k: s.get(k, 0) for k in ("relocated", "evicted_for_room", "evictions")})
        finally:
            m.close(clean=False)
    return out


def _put(m, key: bytes, n: int) -> None:
    slot = m.begin_put(b"bench", key, n, 0, n, 0)
    if slot.status != Status.OK:
        raise click.ClickException(f"put of {n} bytes: {slot.status.name}")
    slot.view[:] = value_for(key, n)
    if m.finish_put(slot) != Status.OK:
        raise click.ClickException(f"commit of {n} bytes failed")


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--memory", default="512MiB", show_default=True, help="Arena size.")
@click.option("--slab-bytes", default="16MiB", show_default=True,
              help="Slab page size (the largest value).")
@click.option("--workload", "workloads", multiple=True, type=click.Choice(WORKLOADS),
              help="Repeat for several; default: all.")
@click.option("--seed", default=1, show_default=True)
@click.option("--churn", "churn_only", is_flag=True,
              help="Only the in-process small-value churn measure (see above).")
@click.option("--json", "json_path", default=None, help="Write the results here too.")
def main(memory: str, slab_bytes: str, workloads: tuple[str, ...], seed: int,
         churn_only: bool, json_path: str | None) -> None:
    mem, slab = parse_size(memory), parse_size(slab_bytes)
    if churn_only:
        r = churn(mem, slab, seed)
        click.echo(json.dumps(r))
        if json_path:
            with open(json_path, "w") as f:
                json.dump(r, f, indent=2)
        return
    results = [run(w, mem, slab, seed) for w in (workloads or WORKLOADS)]
    click.echo(f"arena {format_size(mem)}, slab pages {format_size(slab)}")
    click.echo(f"{'workload':<9} {'45% misses':>11} {'90% misses':>11} "
               f"{'usable (1.5x put)':>18}")
    for r in results:
        f45, f90, u = r["fill45"], r["fill90"], r["usable"]
        click.echo(f"{r['workload']:<9} {f45['missed']:>5}/{f45['values']:<5} "
                   f"{f90['missed']:>5}/{f90['values']:<5} {u['resident_fraction']:>18.3f}")
        if f45["wrong"] or f90["wrong"] or u["wrong"]:
            raise click.ClickException(f"{r['workload']}: wrong bytes read back")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()

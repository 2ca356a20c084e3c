"""``gcache-bench --plot``: GB/s against value size, one line per transport and op."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from gcache.config import format_size


def needs_matplotlib(ctx: Any, param: Any, path: str | None) -> str | None:
    """Click callback of every ``--plot``: a missing matplotlib fails before the run,
    not after minutes of measuring."""
    import importlib.util

    import click

    if path is not None and importlib.util.find_spec("matplotlib") is None:
        raise click.BadParameter("needs matplotlib, which is not installed: "
                                 "pip install 'gcache[bench]' (or drop --plot)")
    return path


def plot_gbps(rows: list[dict[str, Any]], path: str, title: str = "") -> str:
    """Draw ``rows`` (bench result rows) into a PNG at ``path``; returns the path.

    Rows of one (transport, op, threads, batch-independent) series are joined over
    size; when a series has several rows per size (concurrency, batch), the best is
    drawn, which is what "GB/s a transport reaches at this size" means.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here or on CI
    import matplotlib.pyplot as plt

    series: dict[str, dict[int, float]] = defaultdict(dict)
    for r in rows:
        label = f"{r.get('transport', 'auto')} {r['op']}"
        best = series[label].get(r["size"], 0.0)
        series[label][r["size"]] = max(best, float(r["gbps"]))
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for label, pts in sorted(series.items()):
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    sizes = sorted({r["size"] for r in rows})
    ax.set_xticks(sizes, [format_size(x) for x in sizes])
    ax.set_xlabel("value size")
    ax.set_ylabel("GB/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if title:
        import textwrap

        ax.set_title("\n".join(textwrap.wrap(title, 110)), fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

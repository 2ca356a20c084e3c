"""``gcache status`` and ``gcache admin``: the operator's view of, and actions on, the
members, through the masters' API (``gcache.discovery.MasterClient``).

``gcache status`` prints an 80-column table (``status_table``: per member its id and
address, state, memory and disk use, and what it served lately, from the recent figures
its heartbeats carry: GET hit ratio, ops/s, frame p99, ``server/recent.py``), or the
whole /status document (``-o json``), or one tab-separated line per member with raw
numbers (``-o tsv``), or every column (``-o wide``: also the nixl registration, shm
leases and the handoff); ``--watch`` refreshes it. When no master answers, the error names
each master asked and why it failed.

A joining member's state cell shows how far its capacity ramp is (``joining 50%``).

Each member's handoff progress (its ``handoff_*`` stats, carried to the masters by its
heartbeats) is the status table's ``handoff`` column, and what ``gcache admin drain ID
--wait`` follows until the member is empty.

``gcache status --mrc`` adds each member's miss-ratio curve (``mrc_lines``): per namespace,
the estimated GET hit rate from memory now and the change with more (or less) memory."""

from __future__ import annotations

import json
import sys
import time

import click

from gcache.config import format_size
from gcache.view import MemberState


def tier_cells(stats: dict) -> tuple[str, str]:
    """The status table's NVMe-tier cells: "used / capacity" (red when degraded to
    memory-only) and "demoted↓ promoted↑"; "-" for a server without a disk tier."""
    if not stats or "disk_capacity_bytes" not in stats:
        return "-", "-"
    disk = (f"{format_size(stats.get('disk_used_bytes', 0), approx=True)} / "
            f"{format_size(stats['disk_capacity_bytes'], approx=True)}")
    if stats.get("disk_degraded"):
        disk = f"[red]{disk} degraded[/]"
    return disk, f"{stats.get('demoted', 0):,}↓ {stats.get('promoted', 0):,}↑"


def state_cell(m: dict) -> str:
    """The status table's state cell of member ``m`` (a /status row), colored: a joining
    member with its ramp ("joining 50%"), a down member that was drained "(drained)"."""
    colors = {MemberState.UP: "green", MemberState.DRAINING: "yellow",
              MemberState.DOWN: "red", MemberState.JOINING: "cyan"}
    label = m["state"]
    if m["state"] == MemberState.JOINING:
        label += f" {float(m.get('ramp', 1.0)):.0%}"
    elif m.get("drained") and m["state"] == MemberState.DOWN:
        label += " (drained)"
    return f"[{colors.get(m['state'], 'white')}]{label}[/]"


def handoff_cell(stats: dict) -> str:
    """The status table's handoff cell: what the member's handoff worker has left (and
    whether a pass runs), what it moved, what it lost, and why it drained itself if it
    did; "-" when it reports nothing."""
    if not stats or "handoff_passes" not in stats:
        return "-"
    left, moved = stats.get("handoff_objects_left", 0), stats.get("handoff_objects_moved", 0)
    size = format_size(stats.get("handoff_bytes_left", 0), approx=True)
    if stats.get("handoff_active"):
        cell = f"[cyan]moving: {left:,} left ({size})[/], {moved:,} moved"
    elif left:
        cell = f"[yellow]{left:,} waiting ({size})[/], {moved:,} moved"
    elif moved:
        cell = f"done, {moved:,} moved"
    else:
        cell = "-"
    if stats.get("handoff_lost"):
        cell += f", [red]{stats['handoff_lost']:,} lost[/]"
    if stats.get("self_drain"):  # the server drained itself (server/self_drain.py)
        why = f"[yellow]self-drained: {stats['self_drain']}[/]"
        cell = why if cell == "-" else f"{cell}, {why}"
    return cell


def _short_size(n: float) -> str:
    """3 significant digits: "512 MiB", "1 GiB", "1.5 TiB" (a column header)."""
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult:
            return f"{n / mult:.3g} {unit}"
    return f"{n:.0f} B"


def _pct(x: float, sign: bool = False) -> str:
    return f"{100 * x:+.1f}%" if sign else f"{100 * x:.1f}%"


def mrc_lines(member_id: str, stats: dict) -> list[str]:
    """The member's miss-ratio curve (``server/mrc.py``, carried by its heartbeats) as
    lines of at most 80 columns: per namespace (``*``: all), the estimated GET hit rate
    from memory now, and how many points it moves with ``+X GiB`` of memory."""
    doc = (stats or {}).get("mrc")
    if not doc:
        return [f"{member_id}: no miss-ratio curve (--mrc false, or no heartbeat yet)"]
    cap, factors = doc["capacity_bytes"], doc["factors"]
    if 1.0 not in factors:
        return [f"{member_id}: miss-ratio curve without a 1x point"]
    now = factors.index(1.0)
    total = doc["namespaces"].get("*", {})
    out = [f"{member_id}: memory {format_size(cap, approx=True)}, "
           f"{total.get('gets', 0):,} GETs estimated from a {_pct(doc['sample_rate'])} "
           f"key sample"]
    cols = [i for i in range(len(factors)) if i != now]
    out.append(f"  {'namespace':<18} {'now':>6}" + "".join(
        f"{('+' if factors[i] > 1 else '-') + _short_size(abs(factors[i] - 1) * cap):>12}"
        for i in cols))
    for ns, d in doc["namespaces"].items():
        hits = d["hit_ratio"]
        name = ns if len(ns) <= 18 else ns[:17] + "~"
        out.append(f"  {name:<18} {_pct(hits[now]):>6}" + "".join(
            f"{_pct(hits[i] - hits[now], sign=True):>12}" for i in cols))
    return out


def _tls_options(fn):
    """``--tls``/``--tls-ca-file``/``--tls-cert-file``/``--tls-key-file`` (the client
    scope's options), gathered into one ``tls`` dict argument."""
    for flag, help_text in reversed((
            ("--tls-ca-file", "PEM CA bundle that signed the masters' certificates; "
             "implies --tls. [env GCACHE_TLS_CA_FILE]"),
            ("--tls-cert-file", "This client's certificate, for masters that require one "
             "(mTLS). [env GCACHE_TLS_CERT_FILE]"),
            ("--tls-key-file", "Key of --tls-cert-file. [env GCACHE_TLS_KEY_FILE]"))):
        fn = click.option(flag, default=None,
                          envvar="GCACHE_" + flag[2:].upper().replace("-", "_"),
                          help=help_text)(fn)
    return click.option("--tls", is_flag=True, default=None, envvar="GCACHE_TLS",
                        help="Talk https to the masters (verifying them with --tls-ca-file "
                        "or the system store). [env GCACHE_TLS]")(fn)


def _masters_client(masters: str, token: str, tls: dict):
    from gcache.config import load_config
    from gcache.discovery import MasterClient
    from gcache.errors import ConfigError
    from gcache.tls import dialer_context

    try:
        ctx = dialer_context(load_config("client", env={}, cli=tls))
        return MasterClient(masters, token, timeout_s=3.0, tls=ctx)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--masters") from None


def _compact(n: float) -> str:
    """A size in at most 5 characters: "512M", "1.5G", "16G", "1.2T" (binary units)."""
    for unit, mult in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult:
            v = n / mult
            return f"{v:.1f}{unit}" if v < 10 else f"{v:.0f}{unit}"
    return f"{n:.0f}B"


def _rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1e6:.1f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e4 else f"{x:.0f}"


def _ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f}µs" if x < 1 else f"{x:.1f}ms" if x < 100 else f"{x:.0f}ms"


def member_row(m: dict) -> dict:
    """One member of a /status document as plain fields (the json and tsv outputs, and
    the table's cells): the heartbeat's recent figures (``server/recent.py``) included."""
    st = m.get("stats") or {}
    return {"id": m["id"], "address": m["address"], "state": m["state"],
            "ramp": m.get("ramp", 1.0), "incarnation": m.get("incarnation"),
            "capacity_bytes": m.get("capacity_bytes", 0), "used_bytes": st.get("used_bytes"),
            "objects": st.get("objects"), "disk_capacity_bytes": st.get("disk_capacity_bytes"),
            "disk_used_bytes": st.get("disk_used_bytes"),
            "hit_ratio": st.get("recent_hit_ratio"), "ops_per_s": st.get("recent_ops_per_s"),
            "get_bytes_per_s": st.get("recent_get_bytes_per_s"),
            "put_bytes_per_s": st.get("recent_put_bytes_per_s"),
            "p99_ms": st.get("recent_p99_ms"),
            "handoff_objects_left": st.get("handoff_objects_left"),
            "last_heartbeat_s": m.get("last_heartbeat_s")}


TSV_FIELDS = ("id", "address", "state", "incarnation", "capacity_bytes", "used_bytes",
              "objects", "disk_capacity_bytes", "disk_used_bytes", "hit_ratio", "ops_per_s",
              "get_bytes_per_s", "put_bytes_per_s", "p99_ms", "handoff_objects_left",
              "last_heartbeat_s")


def status_tsv(doc: dict) -> str:
    """One header line and one line per member, tab-separated, raw numbers ("" for
    unknown): for scripts (``gcache status -o tsv | cut -f1,10``)."""
    lines = ["\t".join(TSV_FIELDS)]
    for m in doc["members"]:
        row = member_row(m)
        lines.append("\t".join("" if row[f] is None else str(row[f]) for f in TSV_FIELDS))
    return "\n".join(lines)


def status_table(doc: dict):
    """The status table, 80 columns wide: per member its id and address, state and
    heartbeat age, memory (and disk) used of capacity, and what it served lately (GET hit
    ratio, ops/s, frame p99); then one line per member with a handoff under way."""
    from rich import box
    from rich.console import Group
    from rich.table import Table

    n_masters = len(doc.get("masters") or [])
    t = Table(title=f"gcache: epoch {doc['epoch']}, leader {doc.get('leader')}"
              + (f", {n_masters} masters" if n_masters else ""),
              box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for col, right in (("member", False), ("state", False), ("mem/disk", True),
                       ("hit", True), ("ops/s", True), ("p99", True)):
        t.add_column(col, justify="right" if right else "left", no_wrap=col == "member")
    handoffs = []
    for m in doc["members"]:
        st, r = m.get("stats") or {}, member_row(m)
        hb = r["last_heartbeat_s"]
        mem = (f"{_compact(r['used_bytes'])}/{_compact(r['capacity_bytes'])}"
               if r["used_bytes"] is not None else f"-/{_compact(r['capacity_bytes'])}")
        if r["disk_capacity_bytes"]:
            disk = f"{_compact(r['disk_used_bytes'] or 0)}/{_compact(r['disk_capacity_bytes'])}"
            mem += f"\n[red]{disk} degraded[/]" if st.get("disk_degraded") else f"\n{disk}"
        hit = "-" if r["hit_ratio"] is None else f"{100 * r['hit_ratio']:.1f}%"
        t.add_row(f"{m['id']}\n[dim]{m['address']}[/]",
                  state_cell(m) + ("" if hb is None else f"\n[dim]{hb:.1f}s ago[/]"),
                  mem, hit, _rate(r["ops_per_s"]), _ms(r["p99_ms"]))
        cell = handoff_cell(st)
        if cell != "-":
            handoffs.append(f"  {m['id']}: {cell}")
    return Group(t, *(["handoff:", *handoffs] if handoffs else []))


def status_wide(doc: dict):
    """Every column, for a wide terminal (``-o wide``): the table's, plus incarnation,
    object count, disk moves, the nixl registration, shm leases and the handoff."""
    from rich.table import Table

    t = Table(title=f"gcache: epoch {doc['epoch']}, leader {doc.get('leader')}")
    for col in ("id", "address", "state", "inc", "capacity", "used", "objects", "disk",
                "moved", "hit", "ops/s", "p99", "nixl", "leases", "handoff", "heartbeat"):
        t.add_column(col, justify="left" if col in ("id", "address", "state", "handoff",
                                                     "heartbeat") else "right")
    for m in doc["members"]:
        st, r = m.get("stats") or {}, member_row(m)
        hb = r["last_heartbeat_s"]
        t.add_row(m["id"], m["address"], state_cell(m), str(m["incarnation"]),
                  format_size(r["capacity_bytes"], approx=True),
                  format_size(st.get("used_bytes", 0), approx=True) if st else "-",
                  f"{st.get('objects', 0):,}" if st else "-", *tier_cells(st),
                  "-" if r["hit_ratio"] is None else f"{100 * r['hit_ratio']:.1f}%",
                  _rate(r["ops_per_s"]), _ms(r["p99_ms"]),
                  ("on" if st.get("nixl") else "off") if "nixl" in st else "-",
                  f"{st['shm_leases']:,}" if "shm_leases" in st else "-",
                  handoff_cell(st), "-" if hb is None else f"{hb:.1f}s ago")
    return t


def _fetch_status(masters: str, token: str, tls: dict) -> dict:
    from gcache.discovery import MasterError, MasterUnavailable

    try:
        return _masters_client(masters, token, tls).status()
    except (MasterUnavailable, MasterError) as exc:
        raise click.ClickException(str(exc)) from None


@click.command()
@click.option("--masters", required=True, envvar="GCACHE_MASTERS",
              help="Master API addresses HOST:PORT,... [env GCACHE_MASTERS]")
@click.option("--token", default="", envvar="GCACHE_TOKEN", help="[env GCACHE_TOKEN]")
@click.option("--credential", default="", envvar="GCACHE_CREDENTIAL",
              help="'id:secret' with admin on \"*\"; wins over --token. [env GCACHE_CREDENTIAL]")
@_tls_options
@click.option("-o", "--output", type=click.Choice(["table", "wide", "json", "tsv"]),
              default="table", show_default=True,
              help="table for people (80 columns); wide: every column (nixl, leases, "
              "handoff, ...); json (the masters' whole /status document) or tsv (one line "
              "per member, raw numbers) for scripts.")
@click.option("--json", "as_json", is_flag=True, help="Same as -o json.")
@click.option("-w", "--watch", is_flag=True, help="Refresh until Ctrl-C (table: in place; "
              "json and tsv: one document per refresh).")
@click.option("--interval", type=click.FloatRange(0.2), default=2.0, show_default=True,
              help="Seconds between refreshes with --watch.")
@click.option("--mrc", "show_mrc", is_flag=True,
              help="Also show each member's miss-ratio curve: per namespace, the estimated "
              "GET hit rate from memory now and its change with +X GiB (or -X) of memory "
              "(\"+1 GiB  +8.1%\": 1 GiB more memory, 8.1 points more hits).")
def status(masters: str, token: str, credential: str, output: str, as_json: bool, watch: bool,
           interval: float, show_mrc: bool, **tls: object) -> None:
    """Show the leader, the epoch and every member: state, memory and disk use, and what
    it served lately (GET hit ratio, ops/s, frame p99, from its last heartbeat)."""
    from rich.console import Console

    output = "json" if as_json else output
    console = Console(width=None if sys.stdout.isatty() else 200)

    def render(doc: dict):
        if output == "json":
            return json.dumps(doc, indent=2, sort_keys=True)
        if output == "tsv":
            return status_tsv(doc)
        table = status_wide(doc) if output == "wide" else status_table(doc)
        if not show_mrc:
            return table
        from rich.console import Group

        lines = [ln for m in doc["members"] for ln in mrc_lines(m["id"], m.get("stats") or {})]
        return Group(table, "\n".join(lines))

    def emit(doc: dict) -> None:
        out = render(doc)
        if isinstance(out, str):
            click.echo(out)
        else:
            console.print(out)

    key = credential or token
    if not watch:
        emit(_fetch_status(masters, key, tls))
        return
    try:
        if output in ("table", "wide"):
            from rich.live import Live

            with Live(console=console, auto_refresh=False) as live:
                while True:
                    live.update(render(_fetch_status(masters, key, tls)), refresh=True)
                    time.sleep(interval)
        while True:
            emit(_fetch_status(masters, key, tls))
            time.sleep(interval)
    except KeyboardInterrupt:
        pass


@click.group()
def admin() -> None:
    """Operator actions on members (replicated through the masters)."""


def _admin(op: str, member_id: str, masters: str, token: str, tls: dict) -> dict:
    from gcache.discovery import MasterError, MasterUnavailable

    try:
        res = _masters_client(masters, token, tls).admin(op, member_id)
    except (MasterUnavailable, MasterError) as exc:
        raise click.ClickException(str(exc)) from None
    state = (res.get("member") or {}).get("state", "removed")
    click.echo(f"{member_id}: {state} (epoch {res.get('epoch')}, "
               f"{'changed' if res.get('changed') else 'no change'})")
    return res


_masters_opt = click.option("--masters", required=True, envvar="GCACHE_MASTERS",
                            help="Master API addresses. [env GCACHE_MASTERS]")
_token_opt = click.option("--token", default="", envvar="GCACHE_TOKEN", help="[env GCACHE_TOKEN]")
_cred_opt = click.option("--credential", default="", envvar="GCACHE_CREDENTIAL",
                         help="'id:secret' with admin on \"*\"; wins over --token. "
                         "[env GCACHE_CREDENTIAL]")


def _admin_command(name: str, op: str, help_text: str) -> None:
    """``gcache admin NAME MEMBER_ID``: the masters' admin ``op`` on one member."""

    @admin.command(name, help=help_text)
    @click.argument("member_id")
    @_masters_opt
    @_token_opt
    @_cred_opt
    @_tls_options
    def command(member_id: str, masters: str, token: str, credential: str, **tls: object
                ) -> None:
        _admin(op, member_id, masters, credential or token, tls)


for _name, _op, _help in (
        ("add", "undrain", "Bring a drained or down MEMBER_ID back into placement."),
        ("remove", "remove", "Forget MEMBER_ID (it re-registers if it is still running).")):
    _admin_command(_name, _op, _help)


@admin.command("drain")
@click.argument("member_id")
@_masters_opt
@_token_opt
@_cred_opt
@_tls_options
@click.option("--wait", is_flag=True, help="Then follow MEMBER_ID's handoff (a progress bar "
              "of objects, bytes and ETA on stderr) until it holds nothing: exit 0 when it "
              "can be removed, 1 if --timeout passes first.")
@click.option("--timeout", type=click.FloatRange(min=0), default=600.0, show_default=True,
              help="Seconds --wait waits at most.")
def drain(member_id: str, masters: str, token: str, credential: str, wait: bool,
          timeout: float, **tls: object) -> None:
    """Stop placing new keys on MEMBER_ID; it pushes what it holds (memory and disk) to
    the new owners and keeps serving reads until that is done."""
    end = time.monotonic() + timeout
    res = _admin("drain", member_id, masters, credential or token, tls)
    if not wait:
        return
    client = _masters_client(masters, credential or token, tls)
    st = wait_drained(client, member_id, int(res.get("epoch", 0)), end)
    click.echo(f"{member_id}: drained: {st.get('handoff_objects_moved', 0):,} objects "
               f"({format_size(st.get('handoff_bytes_moved', 0), approx=True)}) handed off in "
               f"all, {st.get('handoff_lost', 0):,} lost; it holds nothing and can be removed "
               f"(gcache admin remove {member_id})")


def _drained(m: dict, epoch: int) -> bool:
    """Is member ``m`` (a /status row) draining and empty, after a pass at ``epoch`` or
    later?"""
    st = m.get("stats") or {}
    return (m.get("state") == MemberState.DRAINING and st.get("handoff_epoch", -1) >= epoch
            and not st.get("handoff_active") and st.get("handoff_objects_left", 1) == 0
            and st.get("objects", 1) == 0 and st.get("disk_objects", 0) == 0)


def wait_drained(client, member_id: str, epoch: int, end: float, poll_s: float = 0.5) -> dict:
    """Poll the masters' /status until ``member_id`` is drained (``_drained``), showing
    its handoff as a progress bar on stderr; its last stats. ClickException when it stops
    draining (undrained, down, removed) or ``end`` (``time.monotonic()``) passes first."""
    from rich.console import Console
    from rich.progress import (BarColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    from gcache.discovery import MasterError, MasterUnavailable

    base: tuple[int, int] | None = None  # objects and bytes moved when we started
    st: dict = {}
    columns = (TextColumn("{task.description}"), BarColumn(),
               TextColumn("{task.fields[objects]}"), TextColumn("{task.fields[size]}"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 120)
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(f"draining {member_id}", total=None, objects="", size="")
        while True:
            try:
                doc = client.status(deadline=end)
            except MasterUnavailable:
                doc = None
            except MasterError as exc:
                raise click.ClickException(str(exc)) from None
            if doc is not None:
                m = next((m for m in doc.get("members", []) if m["id"] == member_id), None)
                if m is None:
                    raise click.ClickException(f"{member_id} is no longer a member (removed?); "
                                               "what it held is no longer reachable")
                if m["state"] != MemberState.DRAINING:
                    raise click.ClickException(
                        f"{member_id} is {m['state']}, not draining: its handoff stopped "
                        + ("(what it still holds comes back if it restarts; run the drain "
                           "again then)" if m["state"] == MemberState.DOWN
                           else "(undrained?); run gcache admin drain again"))
                st = m.get("stats") or {}
                if "handoff_passes" in st:
                    if base is None:
                        base = st["handoff_objects_moved"], st["handoff_bytes_moved"]
                    objs = st["handoff_objects_moved"] - base[0]
                    done = st["handoff_bytes_moved"] - base[1]
                    total = done + st["handoff_bytes_left"]
                    bar.update(task, total=max(total, 1), completed=done if total else 1,
                               objects=f"{objs:,}/{objs + st['handoff_objects_left']:,} objects",
                               size=f"{format_size(done, approx=True)}/"
                                    f"{format_size(total, approx=True)}")
                if _drained(m, epoch):
                    return st
            if time.monotonic() + poll_s >= end:
                left = st.get("handoff_objects_left")
                raise click.ClickException(
                    f"{member_id} is not drained yet: "
                    + (f"{left:,} objects ({format_size(st.get('handoff_bytes_left', 0), approx=True)}) "
                       f"left, {st.get('handoff_waiting', 0):,} waiting for their owners"
                       if left is not None else "it reports no handoff progress (an older "
                       "server, or no heartbeat yet)")
                    + "; see gcache status, and wait again with a longer --timeout")
            time.sleep(poll_s)

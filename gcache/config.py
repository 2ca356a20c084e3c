"""The one typed configuration table for gcache servers, clients and the master.

Every tunable lives in ``OPTIONS``; names carry their unit (``_bytes``, ``_ms``).
``load_config`` resolves each option as default < TOML file < ``GCACHE_<NAME>``
environment variable < command-line flag, parses it strictly by type and
range-checks it. Any bad value raises :class:`~gcache.errors.ConfigError` naming
the option, where the value came from, the value, and what to do about it.

Only the stdlib is imported (``click`` lazily, by ``click_options``);
``tomllib`` needs Python 3.11+.
"""

from __future__ import annotations

import difflib
import enum
import logging
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, TypeVar

from gcache.errors import ConfigError

# ---------------------------------------------------------------- parsers

_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# what parse_size also takes, case-insensitively: Kubernetes' "4Gi" / "4G" and "12gb"
_SIZE_ALIASES = {**{u.lower(): v for u, v in _SIZE_UNITS.items()},
                 **{u[0].lower(): v for u, v in _SIZE_UNITS.items() if u.endswith("B") and
                    len(u) == 2},
                 **{u[:2].lower(): v for u, v in _SIZE_UNITS.items() if u.endswith("iB")}}
_MS_UNITS = {"ms": 1, "s": 1000, "m": 60_000}
_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)(?: ?([A-Za-z]+))?")
_MS_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)(?: ?(" + "|".join(_MS_UNITS) + "))?")
_INT_RE = re.compile(r"-?[0-9]+")
_FLOAT_RE = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_BOOLS = {"true": True, "1": True, "yes": True, "on": True,
          "false": False, "0": False, "no": False, "off": False}


def _scaled(text: object, units: dict[str, int], pattern: re.Pattern[str],
            what: str, floats: bool) -> int:
    """Shared body of parse_size / parse_duration_ms: a whole count >= 0 of the base unit."""
    base = next(iter(units))  # the unit worth 1
    if isinstance(text, (int, float)) and not isinstance(text, bool) \
            and (floats or isinstance(text, int)):
        if not math.isfinite(text) or text < 0:
            raise ConfigError(f"{what} {text!r} is negative or not finite")
        amount = Fraction(text)
    elif isinstance(text, str) and (match := pattern.fullmatch(text)):
        amount = Fraction(match[1]) * _unit(units, match[2] or base, text, what)
    else:
        raise ConfigError(f"{text!r} is not a {what}")
    if amount.denominator != 1:
        raise ConfigError(f"{text!r} is not a whole number of {base}")
    return int(amount)


def _unit(units: dict[str, int], unit: str, text: str, what: str) -> int:
    """The multiplier of ``unit``: exact for durations, case-insensitive with the
    Kubernetes short forms for sizes; an unknown unit names the nearest known one."""
    if units is _SIZE_UNITS:
        if (mult := _SIZE_ALIASES.get(unit.lower())) is not None:
            return mult
    elif unit in units:
        return units[unit]
    known = list(units)
    low = unit.lower()

    def closeness(k: str) -> tuple[int, float]:  # shared letters first ("GBi" -> GiB)
        return (len(set(low) & set(k.lower())),
                difflib.SequenceMatcher(None, low, k.lower()).ratio())

    near = max(known, key=closeness)
    hint = (f"; did you mean {text[:len(text) - len(unit)]}{near}?"
            if closeness(near)[0] else "")
    raise ConfigError(f"{text!r} is not a {what}: unknown unit {unit!r} (use one of "
                      f"{', '.join(known)}){hint}")


def parse_size(text: str | int) -> int:
    """Parse a byte size: an int, or "4096", "512B", "64KiB", "1.5GiB", "1 GB", "4Gi".

    KB/MB/GB/TB (and K/M/G/T) are powers of 1000, KiB/MiB/GiB/TiB (and Ki/Mi/Gi/Ti, as
    Kubernetes writes them) powers of 1024. Units are case-insensitive ("12gb"), at most
    one space may precede the unit, and a decimal is allowed only if it comes to a whole
    number of bytes. An unknown unit is refused with the nearest known one.
    """
    return _scaled(text, _SIZE_UNITS, _SIZE_RE, "size", floats=False)


def parse_duration_ms(text: str | int | float) -> int:
    """Parse a duration into whole milliseconds: 250, "500ms", "2s", "1.5s", "1m"."""
    return _scaled(text, _MS_UNITS, _MS_RE, "duration", floats=True)


def format_size(n: int | float, *, approx: bool = False) -> str:
    """Render bytes in the largest binary unit that is exact with <= 2 decimals.

    1048576 -> "1MiB", 1536 -> "1.5KiB", 1000 -> "1000B"; ``parse_size`` inverts it.
    ``approx=True`` is the display form of a usage figure (status tables): two decimals
    in the largest unit up to GiB, "1.50 GiB", "512 B"; it rounds, so it does not round-trip.
    """
    if approx:
        for unit in ("GiB", "MiB", "KiB"):
            if n >= _SIZE_UNITS[unit]:
                return f"{n / _SIZE_UNITS[unit]:.2f} {unit}"
        return f"{n:.0f} B"
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"cannot format {n!r} as a size: need an int >= 0")
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        mult = _SIZE_UNITS[unit]
        if n >= mult and n * 100 % mult == 0:
            whole, cents = divmod(n * 100 // mult, 100)
            return (f"{whole}.{cents:02d}".rstrip("0") if cents else str(whole)) + unit
    return f"{n}B"


def parse_bool(text: str | bool) -> bool:
    """Parse true/false, 1/0, yes/no, on/off (case-insensitive)."""
    if isinstance(text, bool):
        return text
    if isinstance(text, str) and text.lower() in _BOOLS:
        return _BOOLS[text.lower()]
    raise ConfigError(f"{text!r} is not a boolean")


def _parse_int(text: object) -> int:
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    if isinstance(text, str) and _INT_RE.fullmatch(text):
        return int(text)
    raise ConfigError(f"{text!r} is not an integer")


def _parse_float(text: object) -> float:
    if isinstance(text, (int, float, str)) and not isinstance(text, bool):
        if not isinstance(text, str) or _FLOAT_RE.fullmatch(text):
            if math.isfinite(value := float(text)):
                return value
    raise ConfigError(f"{text!r} is not a finite number")


def _parse_str(text: object) -> str:
    if not isinstance(text, str):
        raise ConfigError(f"expected a string, not {type(text).__name__}")
    return text


def _parse_addr(text: object) -> str:
    text = _parse_str(text)
    host, _, port = text.rpartition(":")
    bare_ipv6 = ":" in host and not (host.startswith("[") and host.endswith("]"))
    if text and (not host or bare_ipv6 or not port.isascii() or not port.isdigit()
                 or int(port) > 65535):
        raise ConfigError(f"{text!r} is not HOST:PORT with a port in 0..65535")
    return text  # "" passes here; _check decides per option whether empty is allowed


# type -> (parser, what the operator should write instead)
_TYPES: dict[str, tuple[Callable[[Any], Any], str]] = {
    "size": (parse_size, "use a byte count or a size such as '64KiB', '16GiB', '4Gi' or '1GB'"),
    "int": (_parse_int, "use a whole number such as 4"),
    "float": (_parse_float, "use a number such as 0.9"),
    "bool": (parse_bool, "use true/false, yes/no, on/off or 1/0"),
    "str": (_parse_str, "use a string (quote it in TOML)"),
    "duration_ms": (parse_duration_ms, "use milliseconds or a duration like '500ms' or '2s'"),
    "addr": (_parse_addr, "use HOST:PORT such as '127.0.0.1:7070'"),
}

# ---------------------------------------------------------------- the table

_SCOPES = ("server", "client", "master", "common")


@dataclass(frozen=True, slots=True)
class Option:
    """One configuration option: typed default, help text and scope."""

    name: str
    type: str  # "size" | "int" | "float" | "bool" | "str" | "duration_ms" | "addr"
    default: object
    help: str
    scope: str  # "server" | "client" | "master" | "common"

    @property
    def env(self) -> str:
        """The environment variable that sets this option."""
        return "GCACHE_" + self.name.upper()


_MIB, _GIB = 2**20, 2**30
OPTIONS: dict[str, Option] = {o.name: o for o in [
    Option("listen", "addr", "127.0.0.1:7070", "Address the server listens on.", "server"),
    Option("name", "str", "gcache-0", "Server name used in logs and metrics.", "server"),
    Option("memory_bytes", "size", _GIB, "Size of the shared-memory arena.", "server"),
    Option("token", "str", "", "Shared auth token (legacy: full rights on every namespace); "
           "empty and no credentials_file disables auth.", "common"),
    Option("credential", "str", "", "This process's credential 'id:secret' (an entry of the "
           "credentials file): clients authenticate with it, servers present it to the "
           "masters; overrides token.", "common"),
    Option("credentials_file", "str", "", "TOML file of namespace-scoped credentials "
           "(gcache.credentials); reloaded on SIGHUP. The token still works next to it.",
           "server"),
    Option("quota_file", "str", "", "TOML file of per-namespace memory/disk quotas "
           "([[quota]] tables, gcache.quotas); reloaded on SIGHUP.", "server"),
    Option("metrics_max_namespaces", "int", 64, "Namespaces with their own label in the "
           "per-namespace metrics; later ones are counted as 'other'.", "server"),
    Option("shm_dir", "str", "/dev/shm", "Directory holding the arena file.", "server"),
    Option("shm_group", "str", "", "Group (name or gid) that may read the arena: the file "
           "becomes mode 0640 with this group, so clients of another uid in that group use "
           "shm (they map it read-only; their puts go through their staging files). "
           "Empty = mode 0600, same-uid clients only.", "server"),
    Option("shm_trusted_writers", "bool", False, "Serve ALLOC to same-host clients, which "
           "then write the arena themselves (old SDKs). Off: co-located clients put through "
           "their staging files (PUT_STAGED) and cannot change the arena's bytes; NIXL "
           "peers (--nixl) may ALLOC either way.", "server"),
    Option("slab_bytes", "size", 16 * _MIB, "Largest arena chunk (one value plus its "
           "header): caps the largest value. Changing it starts the arena clean.", "server"),
    Option("max_key_bytes", "int", 512, "Longest accepted key.", "server"),
    Option("max_namespace_bytes", "int", 128, "Longest accepted namespace.", "server"),
    Option("max_value_bytes", "size", 256 * _MIB, "Largest accepted value.", "server"),
    Option("max_batch_items", "int", 4096, "Most items in one batch request.", "server"),
    Option("max_frame_bytes", "size", 512 * _MIB, "Largest accepted wire frame.", "server"),
    Option("max_header_bytes", "size", 4 * _MIB, "Largest accepted frame header.", "server"),
    Option("high_watermark", "float", 0.95, "Arena fill ratio that starts eviction.", "server"),
    Option("low_watermark", "float", 0.90, "Arena fill ratio eviction stops at.", "server"),
    Option("eviction_policy", "str", "lru", "Which objects the memory tier gives up first "
           "(evicts, or demotes to the NVMe tier), and which records the NVMe tier's "
           "compaction and disk quota drop first: lru (least recently used; under a "
           "namespace quota, that namespace's own least recently used); reuse (objects "
           "never read or put again since they came go first, then the others, each least "
           "recently used first); s3fifo (S3-FIFO: small and main FIFO queues and a ghost "
           "of keys); chains (reuse's order, with new objects split by the length of their "
           "prefix chain, from the parent key writers send on put (chain_parent, the SGLang "
           "plugin does): chains under 10, 10-29, 30-59, then 60+ pages and objects with "
           "no parent, and each chain given up from its tail).", "server"),
    Option("recency_snapshot_ms", "duration_ms", 10000, "How often the memory tier saves "
           "its eviction order in the arena (0: only at a clean stop), so a restart after "
           "a crash (kill -9) evicts in the order of at most this long before it. Costs "
           "about 2 us per resident object each time, in 1024-object lock holds.",
           "server"),
    Option("mrc", "bool", True, "Estimate the online miss-ratio curve: per namespace, the "
           "memory hit rate at 0.5x, 1x, 2x, 4x and 8x this server's memory, from a sampled "
           "ghost cache (gcache_mrc_* metrics, STATS, 'gcache status --mrc').", "server"),
    Option("mrc_tracked_keys", "int", 8192, "Most keys the miss-ratio curve's ghost cache "
           "tracks (its memory: ~200 bytes each); fewer sample fewer GETs and estimate "
           "less exactly.", "server"),
    Option("mrc_sample_rate", "float", 0.125, "Highest fraction of keys the miss-ratio "
           "curve samples (it lowers it to keep mrc_tracked_keys); each sampled GET costs "
           "the server a few microseconds.", "server"),
    Option("metrics_listen", "addr", "", "Prometheus HOST:PORT; empty disables.", "server"),
    Option("kv_events_endpoint", "str", "", "ZMQ PUB endpoint to bind (tcp://HOST:PORT or "
           "ipc:///path) where the server publishes KV events (BlockStored / BlockRemoved / "
           "AllBlocksCleared, vLLM's format; topic kv@<name>@<namespace>) for cache-aware "
           "routers; empty disables. Unauthenticated: a non-loopback host needs auth on, like "
           "--listen (docs/kv-events.md).", "server"),
    Option("kv_events_replay_endpoint", "str", "", "ZMQ ROUTER endpoint to bind for replay "
           "and snapshot requests (with kv_events_endpoint); empty disables.", "server"),
    Option("kv_events_queue_events", "int", 65536, "Most KV events waiting for the "
           "publisher thread; more are dropped (never blocking IO), counted in "
           "kv_events_dropped, and subscribers see a sequence gap.", "server"),
    Option("kv_events_buffer_batches", "int", 10000, "Published KV-event batches kept for "
           "replay requests.", "server"),
    Option("log_level", "str", "INFO", "Logging level name.", "server"),
    Option("log_format", "str", "json", "Log format: json or text.", "server"),
    Option("pending_put_timeout_ms", "duration_ms", 10000,
           "How long a sliced put may wait for its other slices (the SDK sends them all "
           "within its timeout_ms); a contributing connection that closes ends it at once.",
           "server"),
    Option("prefault", "bool", True, "Touch every arena page at startup.", "server"),
    Option("remove_arena_on_exit", "bool", False, "Delete the arena file on exit.", "server"),
    Option("max_connections", "int", 1024, "Most concurrent client connections.", "server"),
    Option("max_preauth_connections", "int", 256, "Most connections not yet authenticated, "
           "over all peers (capped at half of max_connections, so strangers never hold every "
           "slot); when full, the oldest one is closed to admit a new one.", "server"),
    Option("max_preauth_per_ip", "int", 128, "Most connections not yet authenticated from "
           "one peer address; more are closed at accept.", "server"),
    Option("handshake_timeout_ms", "duration_ms", 5000, "Deadline from accept to a "
           "finished AUTH; a peer still unauthenticated then is disconnected.", "server"),
    Option("send_timeout_ms", "duration_ms", 10000, "Deadline of one reply (a whole GET "
           "payload included); a peer that does not read it in time is disconnected and "
           "its pins, leases and slots are released.", "server"),
    Option("request_timeout_ms", "duration_ms", 10000, "Deadline for an authenticated "
           "peer to deliver the rest of a request (header and payload) once its 36-byte "
           "prefix arrived; a peer that stalls mid-frame is disconnected and the reservations "
           "its put holds are released.", "server"),
    Option("masters", "str", "", "Master API addresses HOST:PORT,...; empty = no master.",
           "server"),
    Option("advertise", "str", "", "Address clients reach this server at (default: listen).",
           "server"),
    Option("heartbeat_interval_ms", "duration_ms", 500, "Heartbeat period to the masters.",
           "server"),
    Option("migrate_mbps", "float", 0.0, "Cap on the handoff worker's bytes (MB/s, 10^6 "
           "bytes per second): what this server pushes to the new owners on a drain or a "
           "join, so foreground IO keeps its latency; under a cap the handoff also runs at "
           "background CPU priority (SCHED_IDLE) in 2 MiB batches. 0 = no cap: full "
           "speed, normal priority.", "server"),
    Option("handoff_grace_ms", "duration_ms", 2000, "How long a handed-off object's local "
           "copy stays after its new owner acknowledged it. A reader that missed at the "
           "new owner just before the copy landed asks this server next (the SDK's "
           "previous-owner read) within its op deadline, so set it to the longest client "
           "timeout_ms in use (the SDK default is 2000). Drains and joins end this much "
           "after their last copy.", "server"),
    Option("handoff_on_join", "bool", True, "Also push, while this server stays in the "
           "ring, the objects a join moved to another member. Each object goes to the owner "
           "of the placement hash it was put with (its group's, for group= keys and the "
           "SGLang plugin's chain placement), so grouped keys stay together. Off: a join "
           "moves nothing and clients read moved keys from their previous owner for "
           "handoff_read_window_ms. Drains always hand off.", "server"),
    Option("mutable_namespaces", "str", "", "Namespaces whose keys may be written again "
           "with other bytes (comma-separated names or globs, as in the quota file; '*' = "
           "all). A server never serves their objects from before a membership change that "
           "may have given their keys another owner meanwhile: it drops them when it "
           "restarts after such a change and when a range comes back to it, and answers a "
           "reader only for keys it owns in a view at least as new as the reader's. The "
           "others are content namespaces (the key names its value, like KV-cache page "
           "hashes): kept across every change. Give every server the same list.",
           "server"),
    Option("drain_on_stop_ms", "duration_ms", 0, "On SIGTERM (or SIGINT), first drain "
           "this server for at most this long: the masters stop placing keys on it, it keeps "
           "serving while it pushes what it holds (both tiers) to the new owners, and once "
           "nothing is left it deregisters; then it stops. Over budget it stops anyway, "
           "logs what was left and stays draining (a restart under the same name hands off "
           "the rest). A second SIGTERM stops at once. Needs --masters. The service "
           "manager's stop timeout (systemd TimeoutStopSec, Kubernetes "
           "terminationGracePeriodSeconds) must exceed it by about 30 s. 0 = stop at once.",
           "server"),
    Option("unhealthy_file", "str", "", "Platform hook: while this file exists (touched by a "
           "hardware detector, say), the server is unhealthy; checked every second, it then "
           "asks the masters to drain it (once; the drain sticks until gcache admin undrain, "
           "and removing the file undoes nothing). Needs --masters. Empty = off.", "server"),
    Option("auto_drain_after_ms", "duration_ms", 60_000, "With --disk-dir and --masters: "
           "when the disk tier has been degraded (writes failing with EIO or ENOSPC; the "
           "server then serves from memory only) for this long, the server asks the "
           "masters to drain it (once; undone by gcache admin undrain). 0 = never.",
           "server"),
    Option("disk_dir", "str", "", "Directory of the NVMe tier's segment files (one "
           "gcache-<name> subdirectory per server); empty = memory only.", "server"),
    Option("disk_bytes", "size", 16 * _GIB, "Capacity of the NVMe tier (with --disk-dir).",
           "server"),
    Option("segment_bytes", "size", 64 * _MIB, "Size of one NVMe-tier segment file; space "
           "is reclaimed one segment at a time.", "server"),
    Option("promote_policy", "str", "second-hit", "When a disk hit is copied back to memory: "
           "never, first (every hit) or second-hit (second hit within promote_window_ms).",
           "server"),
    Option("promote_window_ms", "duration_ms", 30000, "Window of the second-hit promotion "
           "policy.", "server"),
    Option("disk_io_threads", "int", 8, "Threads that read one GET frame's disk hits in "
           "parallel (queue depth on the NVMe tier).", "server"),
    Option("disk_direct_io", "bool", True, "Bypass the page cache (O_DIRECT) on the NVMe tier; "
           "falls back to buffered IO where unsupported.", "server"),
    Option("nixl", "str", "auto", "NIXL agent over the arena for one-sided RDMA/CMA reads "
           "and writes: auto (when an RDMA device and nixl-cu12 are present), on, off.",
           "server"),
    Option("failpoints", "str", "", "Fault injection for tests, e.g. 'disk_write=eio:3x'; "
           "empty = off.", "server"),
    Option("tls_cert_file", "str", "", "PEM certificate chain this process presents. A "
           "server with one speaks TLS only, on its data port and metrics endpoint, and "
           "dials its masters over https presenting it; a client presents it to servers "
           "and masters that ask (mTLS). Empty = no certificate.", "common"),
    Option("tls_key_file", "str", "", "PEM private key of tls_cert_file (empty: the key is "
           "in the tls_cert_file PEM).", "common"),
    Option("tls_ca_file", "str", "", "PEM CA bundle this process trusts. Clients verify "
           "servers and masters with it (empty = the system store); a TLS server verifies "
           "client certificates and its masters with it.", "common"),
    Option("tls_require_client_cert", "bool", False, "mTLS: refuse clients without a "
           "certificate signed by tls_ca_file (needs tls_cert_file and tls_ca_file).",
           "server"),
    Option("tls", "bool", False, "Speak TLS to servers and masters (on as well when "
           "tls_ca_file or tls_cert_file is set). Refuses transport nixl, whose bytes "
           "bypass the TLS channel.", "client"),
    Option("timeout_ms", "duration_ms", 2000, "Deadline of one client operation.", "client"),
    Option("slice_bytes", "size", _MIB, "Size of one slice of a large value.", "client"),
    Option("conns_per_server", "int", 4, "Connections the client opens per server.", "client"),
    Option("queue_depth", "int", 1024, "Most queued operations per client.", "client"),
    Option("frame_target_bytes", "size", 8 * _MIB, "Batch size the client aims for.", "client"),
    Option("one_hop_max_bytes", "size", 128 << 10, "One-hop: a synchronous call whose "
           "items form one frame for one server, of one key (slice) or of at most this "
           "many bytes (on a shm lane, a get or put frame of any size from "
           "one_sided_min_bytes: its bytes never cross the socket), runs "
           "its IO on the calling thread when a one-hop connection of that "
           "server is idle (no dispatch-thread wake-ups); else, and for every async call, "
           "the dispatch threads run it. A byte get counts slice_bytes per key, a key op "
           "64 B per key. A one-key call without callbacks runs it without building a "
           "batch. 0 = always the dispatch threads.", "client"),
    Option("probe_interval_ms", "duration_ms", 1000, "Health-probe interval.", "client"),
    Option("connect_timeout_ms", "duration_ms", 500, "Deadline to connect.", "client"),
    Option("transport", "str", "auto", "Data path: auto (shm when co-located, else nixl "
           "when the server offers it and this host has an RDMA device, else tcp), tcp, shm "
           "(co-located only) or nixl (servers started with --nixl on/auto).", "client"),
    Option("one_sided_min_bytes", "size", 256 << 10, "Frames smaller than this go as a "
           "plain GET/PUT even on shm/nixl lanes (one round trip beats two control round "
           "trips plus a copy); 1 = always one-sided.", "client"),
    Option("nixl_bounce_bytes", "size", 8 * _MIB, "Registered staging buffer per nixl "
           "connection, used for destinations not registered with register_buffer.",
           "client"),
    Option("verify_checksums", "bool", True, "Check every value read against the "
           "server's xxh3 checksum once its bytes landed; a mismatch is a CORRUPT miss, "
           "never a hit.", "client"),
    Option("stream_gets", "bool", False, "Ask servers for streamed GET replies (a frame "
           "per verified prefix of items, so a disk-served frame's first items travel "
           "while later ones are read). Off by default: at 64 KiB on a shared 2-vCPU host "
           "it cost CPU per item and moved no throughput.", "client"),
    Option("background", "bool", False, "Run this client's dispatch threads, and ask the "
           "servers to run its connections' threads, at background CPU priority "
           "(SCHED_IDLE): for bulk movers that must not delay foreground requests on "
           "shared cores (the servers' handoff uses it). Foreground clients leave it off.",
           "client"),
    Option("handoff_read_window_ms", "duration_ms", 120_000, "For this long after the "
           "masters' ring changed, a get or exists that misses at a key's new owner asks "
           "its previous owner too (its most recent other owner that still holds data: up, "
           "joining or draining), within the op's deadline; "
           "deletes go to both. 0 = never.", "client"),
]}
_SECRETS = frozenset({"token", "credential"})
PROMOTE_POLICIES = ("never", "first", "second-hit")
EVICTION_POLICIES = ("lru", "reuse", "s3fifo", "chains")
NIXL_MODES = ("auto", "on", "off")


class TransportKind(str, enum.Enum):
    """The data path a connection ended up on (wire- and CLI-stable strings)."""

    TCP = "tcp"
    SHM = "shm"
    NIXL = "nixl"


#: What ``transport`` accepts: ``auto`` (shm when co-located, nixl when usable, else
#: tcp) or one kind. The one list; the CLIs and the SDK take it from here.
TRANSPORTS = ("auto",) + tuple(k.value for k in TransportKind)


def scope_options(scope: str) -> list[Option]:
    """The options a ``scope`` process reads: its own plus "common"."""
    if scope not in _SCOPES[:3]:
        raise ConfigError(f"unknown config scope {scope!r}; use one of {', '.join(_SCOPES[:3])}")
    return [o for o in OPTIONS.values() if o.scope in (scope, "common")]


def _show(opt: Option, value: Any) -> str:
    """Human form of a value: sizes in units, secrets masked."""
    if opt.name in _SECRETS and value:
        return "***"
    if opt.type == "size":
        return format_size(value)
    if opt.type == "duration_ms":
        return f"{value}ms"
    if opt.type == "bool":
        return str(value).lower()
    return str(value) or "''"


# numeric options where 0 means "off"
_ZERO_OK = frozenset({"handoff_read_window_ms", "drain_on_stop_ms", "auto_drain_after_ms",
                      "one_hop_max_bytes", "recency_snapshot_ms"})


def _check(opt: Option, value: Any) -> str | None:
    """Range-check one parsed value; return the problem, or None if it is fine."""
    if opt.name in _ZERO_OK and value == 0:
        return None
    if opt.type in ("size", "int", "duration_ms") and value < 1:
        return "must be at least 1"
    if opt.name == "migrate_mbps" and value < 0:
        return "must be >= 0 (0 = no cap)"
    if opt.name.endswith("_watermark") and not 0 < value <= 1:
        return "must be in (0, 1]"
    if opt.type == "addr" and value == "" and opt.name != "metrics_listen":
        return "must not be empty"
    if opt.name == "log_level" and not isinstance(logging.getLevelName(value), int):
        return "must be a logging level such as DEBUG, INFO, WARNING or ERROR"
    if opt.name == "log_format" and value not in ("json", "text"):
        return "must be 'json' or 'text'"
    if opt.name == "promote_policy" and value not in PROMOTE_POLICIES:
        return "must be one of " + ", ".join(PROMOTE_POLICIES)
    if opt.name == "eviction_policy" and value not in EVICTION_POLICIES:
        return "must be one of " + ", ".join(EVICTION_POLICIES)
    if opt.name == "nixl" and value not in NIXL_MODES:
        return "must be one of " + ", ".join(NIXL_MODES)
    if opt.name == "transport" and value not in TRANSPORTS:
        return "must be one of " + ", ".join(TRANSPORTS)
    if opt.name == "segment_bytes" and (value % 4096 or value < _MIB):
        return "must be a multiple of 4KiB and at least 1MiB"
    if opt.name == "credential" and value:
        from gcache.credentials import parse_client_credential

        try:
            parse_client_credential(value)
        except ConfigError as exc:
            return str(exc)
    if opt.name == "mutable_namespaces":
        from gcache.namespace_kinds import parse_globs

        try:
            parse_globs(value)
        except ConfigError as exc:
            return str(exc)
    if opt.name == "failpoints":
        from gcache.failpoints import parse

        try:
            parse(value)
        except ConfigError as exc:
            return str(exc)
    return None


def _coerce(opt: Option, raw: object, source: str) -> Any:
    """Parse and range-check ``raw`` from ``source``; raise a ConfigError saying what to fix."""
    parser, hint = _TYPES[opt.type]
    try:
        value = parser(raw)
    except ConfigError as exc:
        problem: str | None = f"{exc}; {hint}"
    else:
        value = value.upper() if opt.name == "log_level" else value
        problem = _check(opt, value)
    if problem is None:
        return value
    kind, _, detail = source.partition(":")
    where = {"cli": "flag --" + opt.name.replace("_", "-"), "env": "env var " + detail,
             "file": "file " + detail}[kind]
    shown = "'***'" if opt.name in _SECRETS else repr(raw)
    raise ConfigError(f"bad {opt.name} {shown} from {where}: {problem}")

# ---------------------------------------------------------------- loading


class Config:
    """Resolved, immutable configuration of one scope; every option is an attribute."""

    __slots__ = ("_scope", "_values", "_sources")

    def __init__(self, scope: str, values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
        object.__setattr__(self, "_scope", scope)
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_sources", dict(sources))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # slots not set yet (e.g. during copy)
            raise AttributeError(name)
        if name in self._values:
            return self._values[name]
        raise AttributeError(f"{name!r} is not a {self._scope} option")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Config is frozen")

    def __reduce__(self) -> tuple[type[Config], tuple[str, dict[str, Any], dict[str, str]]]:
        return Config, (self._scope, self._values, self._sources)  # copy/pickle despite frozen

    def __repr__(self) -> str:
        body = ", ".join(f"{n}={_show(OPTIONS[n], v)}" for n, v in self._values.items())
        return f"Config({self._scope}: {body})"

    @property
    def scope(self) -> str:
        """The scope this config was loaded for."""
        return self._scope

    @property
    def sources(self) -> dict[str, str]:
        """Where each value came from: "default", "file:<path>", "env:GCACHE_X" or "cli"."""
        return dict(self._sources)

    def as_dict(self) -> dict[str, Any]:
        """A copy of every option value."""
        return dict(self._values)

    def describe(self) -> str:
        """One log line: every value not left at its default, with its source; secrets masked."""
        parts = [f"{n}={_show(OPTIONS[n], self._values[n])} ({src})"
                 for n, src in self._sources.items() if src != "default"]
        return f"gcache {self._scope} config: " + (", ".join(parts) or "all defaults")


def _seconds(raw: object) -> object:
    """A bare number of seconds ("60", 1.5) as a duration; "90s" / "2m" pass through."""
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return f"{raw}s"
    if isinstance(raw, str) and raw.replace(".", "", 1).isdigit():
        return f"{raw}s"
    return raw


# Short names the server's flags also take (``--memory 4GiB``), and a config file too:
# alias -> (option, how a value of the alias becomes a value of the option)
ALIASES: dict[str, tuple[str, Callable[[object], object]]] = {
    "memory": ("memory_bytes", lambda raw: raw),
    "disk": ("disk_bytes", lambda raw: raw),
    "drain_on_stop": ("drain_on_stop_ms", _seconds),
}


def resolve_alias(key: str, value: object) -> tuple[str, object]:
    """``(option name, value)`` for a config key spelled as a flag: dashes or
    underscores ("memory-bytes"), or a short alias ("memory", "drain_on_stop" in seconds)."""
    key = key.replace("-", "_")
    if key in ALIASES:
        name, convert = ALIASES[key]
        return name, convert(value)
    return key, value


def _unknown_key(key: str, allowed: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = (f"it is a {OPTIONS[key].scope}-scope option" if key in OPTIONS
            else f"did you mean {close[0]!r}?" if close else "there is no such option")
    return ConfigError(f"unknown option {key!r} in {where}: {hint}; remove or rename it")


def _read_file(path: str | os.PathLike[str], scope: str) -> dict[str, object]:
    """The ``scope`` values of a TOML file, whose keys must all be known options.

    Keys may sit at top level or in a ``[server]``/``[client]``/``[master]``/
    ``[common]`` table; other scopes' options are skipped so one file can serve all.
    A key may be spelled as its flag is: ``memory-bytes``, or an alias such as
    ``memory`` (see ``ALIASES``).
    """
    label = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {label}: {exc.strerror}; "
                          "fix the path") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {label} is not valid TOML ({exc}); fix it") from None
    tables = {t: data.pop(t) for t in _SCOPES if isinstance(data.get(t), dict)}
    items = [(k, v, None) for k, v in data.items()]
    items += [(k, v, t) for t, table in tables.items() for k, v in table.items()]
    found: dict[str, object] = {}
    for given, value, table in items:
        key, value = resolve_alias(given, value)
        names = [o.name for o in OPTIONS.values() if o.scope in (table or o.scope, "common")]
        if key not in names:
            raise _unknown_key(given, names, f"{label} [{table}]" if table else label)
        if key in found:
            raise ConfigError(f"option {key!r} is set twice in {label} (as {given!r} and "
                              "another spelling); keep only one")
        found[key] = value
    return {k: v for k, v in found.items() if OPTIONS[k].scope in (scope, "common")}


def load_config(scope: str, file: str | os.PathLike[str] | None = None,
                env: Mapping[str, str] | None = None,
                cli: Mapping[str, object] | None = None) -> Config:
    """Resolve every option of ``scope`` with precedence default < file < env < CLI.

    ``env`` defaults to ``os.environ``; only ``GCACHE_<NAME>`` of in-scope options
    is read. ``cli`` maps option names to values; ``None`` means "not given".
    Raises ConfigError for any bad, unknown or inconsistent value.
    """
    opts = {o.name: o for o in scope_options(scope)}
    values = {n: o.default for n, o in opts.items()}
    sources = dict.fromkeys(opts, "default")
    layered: list[tuple[str, object, str]] = []  # (name, raw value, source), lowest first
    if file is not None:
        layered += [(n, v, f"file:{os.fspath(file)}") for n, v in _read_file(file, scope).items()]
    env = os.environ if env is None else env
    layered += [(n, env[o.env], f"env:{o.env}") for n, o in opts.items() if o.env in env]
    for name, raw in (cli or {}).items():
        if name not in opts:
            raise _unknown_key(name, list(opts), f"CLI options for {scope}")
        if raw is not None:
            layered.append((name, raw, "cli"))
    for name, raw, source in layered:
        values[name] = _coerce(opts[name], raw, source)
        sources[name] = source
    if "low_watermark" in values and values["low_watermark"] >= values["high_watermark"]:
        raise ConfigError(
            f"low_watermark {values['low_watermark']} ({sources['low_watermark']}) must be below "
            f"high_watermark {values['high_watermark']} ({sources['high_watermark']}); "
            "lower low_watermark or raise high_watermark")
    return Config(scope, values, sources)


_F = TypeVar("_F", bound=Callable[..., Any])


def click_options(scope: str) -> Callable[[_F], _F]:
    """Decorator adding ``--<name>`` (str, default None) for every option of ``scope``.

    The command's kwargs can go straight to ``load_config(scope, cli=kwargs)``.
    """
    import click  # lazy: the core needs only the stdlib

    def decorate(fn: _F) -> _F:
        for opt in reversed(scope_options(scope)):
            help_text = f"{opt.help} [env {opt.env}, default {_show(opt, opt.default)}]"
            fn = click.option("--" + opt.name.replace("_", "-"), opt.name, type=str,
                              default=None, help=help_text)(fn)
        return fn

    return decorate

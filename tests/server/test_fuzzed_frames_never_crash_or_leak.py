"""A live gcache-server under hypothesis-generated hostile frames.

Each example opens a connection (before or after AUTH, to a server with or without
a token), sends a few structurally interesting frames in one go, half-closes, and
reads every byte the server answers until it closes. The frames are not random
bytes: they start as valid frames of every opcode and then have fields mutated —
prefix fields (opcode incl. unknown, flags, request id, lengths zero / huge /
mismatched, CRC), msgpack headers that are valid maps with wrong types, nested
junk, huge arrays and wrong item shapes (one extra item field included, which a
newer server may accept), undecodable headers, payloads shorter or longer than
declared, and a truncated last frame.

Properties, per example:

* every reply is a well-formed response frame (magic, CRC, FLAG_RESPONSE, a map
  header); an error reply (non-zero status, ``{"error": str}``) is the last thing
  the server sends before it closes;
* a successful reply answers a frame that was sent, in order, with the shape of
  its op (one status per item, GET payload length = the lengths it announces);
* nothing but AUTH and PING succeeds before a successful AUTH, and a fuzzed AUTH
  never succeeds against a server with a token;
* no wrong bytes: every GET hit on a known key is byte-exact (value oracle): the oracle
  namespace, fuzz keys only ever PUT whole, and fuzz keys PUT as slices with any offsets
  (duplicates, gaps, overlaps), whose every byte must have been written by that put.

After the run: the process is alive and serves a normal Client put/get; every
known object written before the run (value oracle, namespace the fuzzer never
writes) reads back byte-exact, and so does every fuzz key written whole or in slices;
STATS shows no shm lease, shm slot or pending put left; the thread count returns
near its baseline; RSS grew by less than 64 MiB; the log holds no traceback.

Reproducible: derandomized, no example database. ``GCACHE_FUZZ_EXAMPLES=N`` runs
more examples locally (e.g. 5000 for a long soak). The server keeps state between
examples, so a finding that needs an earlier example's leftovers (a pending slice, a
reused chunk) is reported by hypothesis as a FlakyFailure; the assertion inside it is the
finding.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gcache.errors import ProtocolError
from gcache.hashing import checksum
from gcache.protocol import (FLAG_RESPONSE, MAGIC, PREFIX, PREFIX_SIZE, VERSION, Limits, Op,
                             check_crc, decode_meta, decode_prefix)
from gcache.sdk import Client
from gcache.status import Status
from gcache.testing.oracle import check_value, fill_value

from rawwire import RawConn, assert_serving, rss_bytes, server_log

pytestmark = [pytest.mark.integration, pytest.mark.faults]

EXAMPLES = int(os.environ.get("GCACHE_FUZZ_EXAMPLES", "250"))
TOKEN = "fuzz-token-0123456789abcdef"
MIB = 1 << 20
SLAB = MIB  # the Cluster default: anything larger is refused before a reservation
LIM = Limits()
# a reply may legitimately carry up to max_frame_bytes of payload
READ_LIMITS = Limits(max_header_bytes=64 * MIB, max_frame_bytes=LIM.max_frame_bytes)

ORACLE_NS = b"fuzz-oracle-known"  # written before the run; the fuzzer only reads it
ORACLE_KEYS = [b"known-%02d" % i for i in range(24)]
FUZZ_NS = b"fuzz-ns"
CLEAN_KEYS = [b"fuzz-clean-%d" % i for i in range(4)]  # only ever PUT whole, oracle bytes
# PUT slices (any offsets), oracle bytes; many keys, so a chunk rarely comes back to the
# key that used it before (stale bytes of an older version would pass the oracle)
SLICE_KEYS = [b"fuzz-sliced-%d" % i for i in range(64)]
WILD_KEYS = [b"w", b"w2", b"wild-key-3"]  # anything goes: ALLOC, junk lengths
READ_KEYS = ORACLE_KEYS + CLEAN_KEYS + SLICE_KEYS[:4] + WILD_KEYS
CAP = 64 << 10  # biggest value the fuzzer writes (keeps the arena from evicting)


def _oracle_size(i: int) -> int:
    return [0, 1, 7, 8, 9, 4095, 4096, 4097, 65536, 40_000, 123, 1000][i % 12] + i


def _oracle_bytes(key: bytes, n: int) -> bytes:
    buf = bytearray(n)
    fill_value(key, buf)
    return bytes(buf)


# ------------------------------------------------------------------ strategies
#
# Every field is drawn "good" most of the time and hostile now and then (``pick``), so a
# frame usually carries zero or one defect and the server gets past it to the next check.

SPECIAL_INTS = [0, 1, 2, 7, 8, 255, 4096, 65535, -1, -2, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
                2**63 - 1, 2**63, 2**64 - 1, -2**63, SLAB, SLAB + 1, 256 * MIB, 256 * MIB + 1,
                LIM.max_frame_bytes + 1]
INTS = st.one_of(st.sampled_from(SPECIAL_INTS), st.integers(0, 70_000),
                 st.integers(-2**63, 2**64 - 1), st.booleans())
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1),
                    st.floats(allow_nan=True), st.binary(max_size=16), TEXT,
                    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8)))
JUNK = st.recursive(SCALARS, lambda ch: st.one_of(
    st.lists(ch, max_size=4),
    st.dictionaries(st.one_of(st.binary(max_size=4), TEXT, st.integers(-5, 5)), ch,
                    max_size=3)), max_leaves=8)
PERCENT = st.integers(0, 99)
HUGE_N = st.sampled_from([LIM.max_batch_items + 1, 20_000])
BAD_NS = st.one_of(st.binary(max_size=4), st.just(b"n" * (LIM.max_namespace_bytes + 1)), JUNK)
BAD_KEY = st.one_of(st.binary(max_size=6), st.just(b""),
                    st.just(b"k" * (LIM.max_key_bytes + 1)), JUNK)
EXTRA_FIELD = st.one_of(INTS, st.binary(max_size=8), JUNK)
WRONG_SHAPE = st.one_of(st.lists(st.one_of(INTS, st.binary(max_size=6), JUNK), max_size=7),
                        JUNK)
SMALL_ID = st.integers(0, 5)
SLICE_TOTAL = st.sampled_from([0, 1, 8, 100, 4096, 40_000])
PUT_ID = st.sampled_from([0, 1, 5, 2**64 - 1])
EXTRA_MAP = st.dictionaries(st.sampled_from(["ep", "ph", "x", "mac", "ns", "items", "zz"]),
                            st.one_of(INTS, JUNK), max_size=2)


def chance(draw, pct: int) -> bool:
    """True ``pct`` % of the time; False for the small draws hypothesis favours and
    shrinks towards, so a minimal failing example carries the fewest defects."""
    return draw(PERCENT) >= 100 - pct


def pick(draw, good: st.SearchStrategy, bad: st.SearchStrategy, bad_pct: int = 12) -> Any:
    return draw(bad) if chance(draw, bad_pct) else draw(good)


def draw_ns(draw, readable: bool) -> Any:
    """The fuzz namespace (and for read-only ops the oracle one); never the oracle
    namespace for an op that writes or deletes."""
    good = [FUZZ_NS, FUZZ_NS, b""] + ([ORACLE_NS] * 3 if readable else [])
    return pick(draw, st.sampled_from(good), BAD_NS)


def draw_key(draw, pool: list[bytes]) -> Any:
    return pick(draw, st.sampled_from(pool), BAD_KEY)


def draw_list(draw, item, max_size: int, huge_item: Any) -> Any:
    """A list of ``item(draw)``; now and then one longer than max_batch_items, or junk."""
    r = draw(PERCENT)
    if r >= 96:
        return [huge_item] * draw(HUGE_N)
    if r >= 92:
        return draw(JUNK)
    return [item(draw) for _ in range(draw(st.integers(0 if r >= 88 else 1, max_size)))]


def with_extra(draw, item: list) -> Any:
    """The item; now and then with one extra field (a checksum, say), or the wrong shape."""
    r = draw(PERCENT)
    if r >= 94:
        return item + [draw(EXTRA_FIELD)]
    if r >= 88:
        return draw(WRONG_SHAPE)
    return item


def with_checksum(draw, item: list, key: bytes) -> list:
    """Now and then, the item with its value's checksum (xxh3 of the whole oracle value)
    appended, as a newer SDK sends it; a server that verifies it must accept it."""
    return item + [checksum(_oracle_bytes(key, item[1]))] if chance(draw, 30) else item


def put_item(draw, op: int, payload: list[bytes] | None, plan: tuple) -> Any:
    """One PUT/ALLOC item; appends its exact bytes to ``payload`` (None: not sendable).

    CLEAN keys are only ever written whole with their oracle bytes (PUT only), so any hit
    on them must be byte-exact; WILD keys get slices, ALLOC and junk lengths."""
    kind = draw(st.sampled_from(["slice", "slice", "clean", "clean", "wild"]))
    if op == Op.PUT and kind == "clean":
        key = draw(st.sampled_from(CLEAN_KEYS))
        n = draw(st.one_of(st.integers(0, 64), st.integers(0, CAP)))
        if payload is not None:
            payload.append(_oracle_bytes(key, n))
        return with_checksum(draw, [key, n, 0, n, draw(PUT_ID)], key)
    if op == Op.PUT and kind == "slice":
        # mostly the example's one sliced object (key, total, put_id), so slices meet:
        # duplicates, gaps, overlaps, slices over several frames and connections
        key, tl, pid = plan if not chance(draw, 30) else (
            draw(st.sampled_from(SLICE_KEYS)), draw(SLICE_TOTAL), draw(PUT_ID))
        off = draw(st.one_of(st.just(0), st.integers(0, tl)))
        ln = draw(st.one_of(st.just(tl - off), st.integers(0, tl - off)))
        if payload is not None:
            payload.append(_oracle_bytes(key, off + ln)[off:])
        return with_checksum(draw, [key, tl, off, ln, pid], key)
    key = draw_key(draw, WILD_KEYS)
    if chance(draw, 15):
        ints = [draw(INTS) for _ in range(4)]
        if payload is not None and isinstance(ints[2], int) and 0 <= ints[2] <= CAP:
            payload.append(b"\xee" * ints[2])
        return with_extra(draw, [key, *ints])
    tl = draw(st.one_of(SLICE_TOTAL, st.integers(0, CAP)))
    off = draw(st.one_of(st.just(0), st.integers(0, tl)))
    ln = draw(st.one_of(st.just(tl - off), st.integers(0, tl - off)))
    if payload is not None:
        payload.append(b"\xee" * ln)
    item = [key, tl, off, ln, draw(PUT_ID)]
    if op == Op.ALLOC and not chance(draw, 20):  # a checksum nobody will write bytes for
        item.append(draw(st.integers(0, 2**64 - 1)))
    return with_extra(draw, item)


def get_item(draw) -> Any:
    key = draw_key(draw, READ_KEYS)
    off = pick(draw, st.one_of(st.just(0), st.integers(0, 70_000)), INTS, 20)
    mx = pick(draw, st.one_of(st.just(1 << 20), st.integers(0, 70_000)), INTS, 20)
    ev = pick(draw, st.just(0), INTS, 10)
    return with_extra(draw, [key, off, mx, ev])


def lease_item(draw) -> Any:
    return with_extra(draw, [draw_key(draw, READ_KEYS), pick(draw, st.just(0), INTS, 10)])


def ids(draw) -> Any:
    return draw_list(draw, lambda d: pick(d, SMALL_ID, INTS), 5, 1)


def with_junk_fields(draw, meta: dict) -> Any:
    """The map; now and then with unknown keys or 'ep'/'ph' (ownership) junk added."""
    return {**meta, **draw(EXTRA_MAP)} if chance(draw, 10) else meta


KNOWN_OPS = [Op.PUT, Op.GET, Op.EXISTS, Op.DELETE, Op.TOUCH, Op.STATS, Op.LEASE, Op.RELEASE,
             Op.ALLOC, Op.COMMIT, Op.PING, Op.AUTH, Op.HELLO]
DATA_OPS = [Op.PUT, Op.PUT, Op.GET, Op.GET, Op.GET, Op.EXISTS, Op.DELETE, Op.TOUCH, Op.STATS,
            Op.LEASE, Op.RELEASE, Op.ALLOC, Op.ALLOC, Op.COMMIT, Op.PING]
FOLLOW_UP = {Op.ALLOC: Op.COMMIT, Op.LEASE: Op.RELEASE, Op.PUT: Op.GET}


def op_meta(draw, op: int, plan: tuple = (SLICE_KEYS[0], 100, 1)) -> tuple[Any, bytes | None]:
    """A plausible header for ``op`` and its exact payload (None: no sendable payload)."""
    if op in (Op.PUT, Op.ALLOC):
        payload: list[bytes] | None = [] if op == Op.PUT else None
        items = draw_list(draw, lambda d: put_item(d, op, payload, plan), 4, [b"w", 1, 0, 1, 0])
        meta = {"ns": draw_ns(draw, False), "items": items}
        data = b"".join(payload) if payload is not None else b""
        sendable = op == Op.ALLOC or (isinstance(items, list) and len(items) <= 4)
        return with_junk_fields(draw, meta), (data if sendable else None)
    if op == Op.GET and chance(draw, 30):  # read back the example's sliced object
        return {"ns": FUZZ_NS, "items": [[plan[0], 0, 1 << 20, 0]]}, b""
    if op == Op.GET:
        return with_junk_fields(draw, {"ns": draw_ns(draw, True), "items": draw_list(
            draw, get_item, 6, [ORACLE_KEYS[3], 0, 10, 0])}), b""
    if op in (Op.EXISTS, Op.TOUCH, Op.DELETE):
        pool = CLEAN_KEYS + SLICE_KEYS[:4] + WILD_KEYS + (ORACLE_KEYS if op != Op.DELETE else [])
        return with_junk_fields(draw, {"ns": draw_ns(draw, op != Op.DELETE), "items": draw_list(
            draw, lambda d: draw_key(d, pool), 6, b"w")}), b""
    if op == Op.LEASE:
        return with_junk_fields(draw, {"ns": draw_ns(draw, True), "items": draw_list(
            draw, lease_item, 5, [ORACLE_KEYS[3], 0])}), b""
    if op == Op.RELEASE:
        return with_junk_fields(draw, {"leases": ids(draw)}), b""
    if op == Op.COMMIT:
        return with_junk_fields(draw, {"slots": ids(draw), "abort": ids(draw)}), b""
    if op == Op.AUTH:
        return {"mac": pick(draw, st.binary(min_size=32, max_size=32),
                            st.one_of(st.binary(max_size=40), JUNK), 30)}, b""
    return pick(draw, st.just({}), st.dictionaries(TEXT, JUNK, max_size=3), 30), b""


@dataclass
class Sent:
    """One fuzzed frame: its bytes, and the header the server will parse (when intact)."""

    data: bytes
    op: int
    rid: int
    meta: Any
    intact: bool  # prefix lengths, CRC and header are what a correct sender writes
    note: str = ""


def _prefix(op: int, rid: int, hlen: int, plen: int, *, flags: int = 0, status: int = 0,
            magic: int = MAGIC, version: int = VERSION, reserved: int = 0) -> bytes:
    return PREFIX.pack(magic, version, op, flags, rid, status, reserved, hlen, plen,
                       0)[:PREFIX_SIZE - 4]


# at most one frame-level defect per frame; "none" about half the time
DEFECTS = ["none"] * 24 + [
    "meta-of-other-op", "not-a-map", "raw-header", "trailing-bytes", "cut-header",
    "nested-arrays", "claims-huge-array", "empty-header", "plen-lies", "short-payload",
    "long-payload", "huge-plen", "hlen-lies", "hlen-huge", "flags", "status", "magic",
    "version", "reserved", "bad-crc", "crc-of-what-server-reads", "payload-where-none",
    "unknown-opcode"]


@st.composite
def frame(draw, index: int, prev_op: int | None, plan: tuple) -> Sent:
    if prev_op in FOLLOW_UP and chance(draw, 50):
        op = FOLLOW_UP[prev_op]
    else:
        op = draw(st.sampled_from(DATA_OPS))
    defect = draw(st.sampled_from(DEFECTS))
    meta_op = op
    if defect == "meta-of-other-op":
        meta_op = draw(st.sampled_from(KNOWN_OPS))
    elif defect == "unknown-opcode":
        op = draw(st.one_of(st.integers(0, 255), st.sampled_from([Op.HELLO, 4, 15, 34, 255])))
    meta, payload = op_meta(draw, meta_op, plan)
    if op != meta_op and isinstance(meta, dict) and meta.get("ns") == ORACLE_NS:
        meta = {**meta, "ns": FUZZ_NS}  # never an oracle-namespace header under a write op
    if defect == "not-a-map":
        meta = draw(JUNK)
    rid = draw(st.one_of(st.just(1000 + index), st.just(1000 + index), st.just(0),
                         st.integers(0, 2**64 - 1)))
    header = msgpack.packb(meta, use_bin_type=True)
    if payload is None:  # items that describe no sendable payload: send a little anyway
        payload = draw(st.sampled_from([b"", b"p" * 8, b"q" * 4096]))
    flags = status = reserved = 0
    magic, version = MAGIC, VERSION
    if defect == "raw-header":
        header = draw(st.binary(max_size=64))
    elif defect == "trailing-bytes":
        header += draw(st.binary(min_size=1, max_size=4))
    elif defect == "cut-header":
        header = header[:draw(st.integers(0, max(0, len(header) - 1)))]
    elif defect == "nested-arrays":
        header = b"\x91" * draw(st.integers(1, 3000)) + b"\xc0"
    elif defect == "claims-huge-array":
        header = draw(st.sampled_from([b"\xdd", b"\xdf"])) + b"\xff\xff\xff\xff" + \
            draw(st.binary(max_size=8))
    elif defect == "empty-header":
        header = b""
    elif defect == "short-payload" and payload:
        payload = payload[:draw(st.integers(0, len(payload) - 1))]
    elif defect == "long-payload":
        payload += draw(st.binary(min_size=1, max_size=40))
    elif defect == "payload-where-none":
        payload = draw(st.sampled_from([b"x", b"y" * 100]))
    elif defect == "flags":
        flags = draw(st.sampled_from([FLAG_RESPONSE, 0xFFFF, 0x0002, 0x8000]))
    elif defect == "status":
        status = draw(st.sampled_from([1, 7, 0xFFFF]))
    elif defect == "magic":
        magic = draw(st.sampled_from([0x50545448, 0, MAGIC ^ 0x100]))
    elif defect == "version":
        version = draw(st.sampled_from([0, 2, 255]))
    elif defect == "reserved":
        reserved = 0xFFFF
    hlen, plen = len(header), len(payload)
    if defect == "plen-lies":
        plen = draw(st.integers(0, len(payload) + 64))
    elif defect == "huge-plen":
        plen = draw(st.sampled_from([LIM.max_frame_bytes, LIM.max_frame_bytes + 1, 2**60,
                                     2**64 - 1, 256 * MIB]))
    elif defect == "hlen-lies":
        hlen = draw(st.integers(0, len(header) + 64))
    elif defect == "hlen-huge":
        hlen = draw(st.sampled_from([LIM.max_header_bytes, LIM.max_header_bytes + 1,
                                     2**32 - 1, 64 * 1024 + 1]))
    fixed = _prefix(op, rid, hlen, plen, flags=flags, status=status, magic=magic,
                    version=version, reserved=reserved)
    after = header + payload
    crc = zlib.crc32(header, zlib.crc32(fixed))
    if defect == "crc-of-what-server-reads":  # lengths lie, yet the CRC checks out
        hlen = draw(st.integers(0, len(after)))
        fixed = _prefix(op, rid, hlen, max(0, len(after) - hlen), flags=flags)
        crc = zlib.crc32(after[:hlen], zlib.crc32(fixed))
    elif defect == "bad-crc":
        crc ^= 1 << draw(st.integers(0, 31))
    intact = defect in ("none", "meta-of-other-op", "not-a-map", "unknown-opcode",
                        "payload-where-none", "reserved") and (hlen, plen) == (len(header),
                                                                                len(payload))
    data = fixed + crc.to_bytes(4, "little") + after
    return Sent(data, op, rid, meta if intact else None, intact, defect)


@dataclass
class Example:
    auth: bool  # authenticate properly (RawConn.auth) before sending the frames
    frames: list[Sent]
    cut: int | None  # truncate the whole stream to this many bytes
    chunks: list[int] = field(default_factory=list)  # split points (partial writes)

    def __repr__(self) -> str:
        fs = "\n  ".join(f"op={f.op} rid={f.rid} {f.note} meta={f.meta!r:.300} "
                         f"len={len(f.data)}" for f in self.frames)
        return f"Example(auth={self.auth}, cut={self.cut}, frames=\n  {fs})"


@st.composite
def examples(draw) -> Example:
    auth = not chance(draw, 30)
    frames: list[Sent] = []
    if not auth and not chance(draw, 40):  # before AUTH: lead with a fuzzed AUTH
        meta, _ = op_meta(draw, Op.AUTH)
        frames.append(Sent(_frame_bytes(Op.AUTH, 999, meta), Op.AUTH, 999, meta, True))
    plan = (draw(st.sampled_from(SLICE_KEYS)), draw(SLICE_TOTAL), draw(PUT_ID))
    prev = None
    for i in range(draw(st.integers(1, 5))):
        frames.append(draw(frame(i, prev, plan)))
        prev = frames[-1].op
    total = sum(len(f.data) for f in frames)
    cut = draw(st.integers(0, max(0, total - 1))) if chance(draw, 15) else None
    chunks = sorted(draw(st.lists(st.integers(1, max(1, total)), max_size=3)))
    return Example(auth, frames, cut, chunks)


def _frame_bytes(op: int, rid: int, meta: Any, payload: bytes = b"") -> bytes:
    header = msgpack.packb(meta, use_bin_type=True)
    fixed = _prefix(op, rid, len(header), len(payload))
    return fixed + zlib.crc32(header, zlib.crc32(fixed)).to_bytes(4, "little") + header + payload


# ------------------------------------------------------------------ the oracle of replies

@dataclass
class Reply:
    opcode: int
    rid: int
    status: int
    flags: int
    meta: Any
    payload: bytes


def parse_replies(buf: bytes) -> list[Reply]:
    out, pos = [], 0
    while pos < len(buf):
        prefix = buf[pos:pos + PREFIX_SIZE]
        assert len(prefix) == PREFIX_SIZE, f"torn reply prefix: {len(prefix)} bytes at {pos}"
        fh = decode_prefix(prefix, READ_LIMITS)
        pos += PREFIX_SIZE
        header = buf[pos:pos + fh.header_len]
        assert len(header) == fh.header_len, "torn reply header"
        check_crc(prefix, header)
        meta = decode_meta(header)
        pos += fh.header_len
        payload = buf[pos:pos + fh.payload_len]
        assert len(payload) == fh.payload_len, "torn reply payload"
        pos += fh.payload_len
        out.append(Reply(fh.opcode, fh.request_id, fh.status, fh.flags, meta, payload))
    return out


def _is_int_list(x: Any, n: int | None = None) -> bool:
    return (isinstance(x, list) and all(isinstance(i, int) for i in x)
            and (n is None or len(x) == n))


def _known_len(meta: Any, field_: str) -> int | None:
    if isinstance(meta, dict) and isinstance(meta.get(field_), list):
        return len(meta[field_])
    return None


def check_get_reply(sent: Sent, rep: Reply, oracle_sizes: dict[bytes, int]) -> None:
    items = rep.meta.get("items")
    assert isinstance(items, list), rep.meta
    assert all(_is_int_list(x) and len(x) >= 4 for x in items), items
    assert sum(x[3] for x in items) == len(rep.payload), "GET payload != announced lengths"
    req = sent.meta
    if not (isinstance(req, dict) and isinstance(req.get("items"), list)):
        return
    ns = req.get("ns", b"")
    assert len(items) == len(req["items"]), (len(items), len(req["items"]))
    pos = 0
    for (st_, total, _ver, n, *_), want in zip(items, req["items"]):
        data = rep.payload[pos:pos + n]
        pos += n
        if st_ != Status.OK:
            assert n == 0, f"a {Status(st_).name} GET item carries {n} bytes"
            continue
        key, off, mx = want[0], want[1], want[2]
        assert n <= mx and n <= max(0, total - off), (n, total, off, mx)
        if ns == ORACLE_NS:
            assert total == oracle_sizes.get(key), f"{key!r}: total {total} is not its size"
        if ns == ORACLE_NS or (ns == FUZZ_NS and key in CLEAN_KEYS + SLICE_KEYS):
            assert check_value(key, data, offset=min(off, total)), \
                f"WRONG BYTES for {ns!r}/{key!r} at offset {off} ({n} bytes)"


def check_ok_reply(sent: Sent, rep: Reply, oracle_sizes: dict[bytes, int]) -> None:
    meta, op = rep.meta, rep.opcode
    if op != Op.GET:
        assert rep.payload == b"", f"op {op} reply carries a payload"
    if op == Op.PING:
        assert "name" in meta
    elif op == Op.AUTH:
        assert meta.get("ok") is True, meta
    elif op == Op.STATS:
        assert isinstance(meta.get("stats"), dict), meta
    elif op == Op.GET:
        check_get_reply(sent, rep, oracle_sizes)
    elif op in (Op.PUT, Op.EXISTS, Op.DELETE, Op.TOUCH, Op.RELEASE, Op.COMMIT):
        want = _known_len(sent.meta, {Op.RELEASE: "leases", Op.COMMIT: "slots"}.get(op, "items"))
        assert _is_int_list(meta.get("st"), want), (meta, want)
        assert all(0 <= s <= max(Status) for s in meta["st"]), meta
    elif op in (Op.LEASE, Op.ALLOC):
        items, want = meta.get("items"), _known_len(sent.meta, "items")
        assert isinstance(items, list) and (want is None or len(items) == want), (meta, want)
        assert all(_is_int_list(x) and len(x) >= (5 if op == Op.LEASE else 3)
                   for x in items), items
    else:
        raise AssertionError(f"op {op} answered OK")


def check_exchange(ex: Example, token: str, replies: list[Reply],
                   oracle_sizes: dict[bytes, int]) -> None:
    authed = ex.auth
    next_frame = 0
    for i, rep in enumerate(replies):
        assert rep.flags & FLAG_RESPONSE, f"reply {i} lacks FLAG_RESPONSE"
        assert isinstance(rep.meta, dict), f"reply {i} header is not a map: {rep.meta!r}"
        if rep.status != 0:
            assert i == len(replies) - 1, f"the server kept talking after error reply {i}"
            assert rep.payload == b"" and isinstance(rep.meta.get("error"), str), rep.meta
            assert rep.status <= max(Status), rep.status
            return
        # a success answers a frame we sent, in order
        match = next((j for j in range(next_frame, len(ex.frames))
                      if (ex.frames[j].op, ex.frames[j].rid) == (rep.opcode, rep.rid)), None)
        assert match is not None, f"reply {i} (op {rep.opcode}, rid {rep.rid}) answers nothing"
        next_frame = match + 1
        sent = ex.frames[match]
        if rep.opcode == Op.AUTH:
            assert not token, "a fuzzed AUTH was accepted by a server with a token"
            authed = True
        elif rep.opcode != Op.PING:
            assert authed, f"op {rep.opcode} answered OK before AUTH"
        check_ok_reply(sent, rep, oracle_sizes)


def exchange(addr: str, ex: Example, token: str) -> list[Reply]:
    """Send the example's bytes, half-close, and return every reply until the server
    closes (which it must do within the deadline: our EOF ends every stream)."""
    with RawConn(addr, timeout=10) as conn:
        if ex.auth:
            conn.auth(token)
        data = b"".join(f.data for f in ex.frames)
        if ex.cut is not None:
            data = data[:ex.cut]

        def send() -> None:  # its own thread: big replies must not deadlock our sends
            try:
                last = 0
                for c in [*[c for c in ex.chunks if c < len(data)], len(data)]:
                    conn.sock.sendall(data[last:c])
                    last = c
                conn.half_close()
            except OSError:
                pass  # the server refused and closed: its reply is still readable

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        got = bytearray()
        end = time.monotonic() + 10
        while True:
            left = end - time.monotonic()
            assert left > 0, f"the server kept the connection open after our EOF ({ex!r})"
            conn.sock.settimeout(left)
            try:
                chunk = conn.sock.recv(1 << 20)
            except ConnectionResetError:
                break
            except socket.timeout:
                raise AssertionError(f"the server kept the connection open ({ex!r})") from None
            if not chunk:
                break
            got += chunk
        sender.join(10)
    try:
        return parse_replies(bytes(got))
    except ProtocolError as exc:
        raise AssertionError(f"malformed reply stream: {exc}") from None


# ------------------------------------------------------------------ helpers for the run

def proc_status(pid: int, field_: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field_ + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field_} in /proc/{pid}/status")


def stats_of(addr: str, token: str) -> dict:
    with RawConn(addr) as conn:
        conn.auth(token)
        conn.send(_frame_bytes(Op.STATS, 7, {}))
        fh, meta = conn.read()
        assert fh.status == 0, meta
        return meta["stats"]


def wait_for(pred, timeout: float):
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > end:
            return v
        time.sleep(0.1)


def write_oracle(addr: str, token: str) -> dict[bytes, int]:
    sizes = {k: _oracle_size(i) for i, k in enumerate(ORACLE_KEYS)}
    with Client(servers=[addr], namespace=ORACLE_NS, timeout_ms=5000, token=token) as c:
        for k, n in sizes.items():
            assert c.put(k, _oracle_bytes(k, n)) == Status.OK, k
    return sizes


def check_oracle(addr: str, token: str, sizes: dict[bytes, int], evictions: int) -> None:
    with Client(servers=[addr], namespace=ORACLE_NS, timeout_ms=5000, token=token) as c:
        for k, n in sizes.items():
            v = c.get(k)
            assert v is not None, f"known object {k!r} lost ({evictions} evictions)"
            assert len(v) == n and check_value(k, v), f"WRONG BYTES read back for {k!r}"
    with Client(servers=[addr], namespace=FUZZ_NS, timeout_ms=5000, token=token) as c:
        for k in CLEAN_KEYS + SLICE_KEYS:
            v = c.get(k)
            assert v is None or check_value(k, v), f"WRONG BYTES for fuzz key {k!r}"


def warm_up(addr: str, token: str) -> None:
    """Touch every code path that starts a thread or a cache once (shm reaper, SDK)."""
    with RawConn(addr) as conn:
        conn.auth(token)
        conn.send(_frame_bytes(Op.LEASE, 1, {"ns": ORACLE_NS, "items": [[ORACLE_KEYS[5], 0]]}))
        conn.read()


# ------------------------------------------------------------------ the test

@pytest.mark.timeout(150)
@pytest.mark.parametrize("token", ["", TOKEN], ids=["no-token", "token"])
def test_fuzzed_frames_never_crash_leak_or_serve_wrong_bytes(make_cluster, token):
    cluster = make_cluster(1, "64MiB", token=token,
                           extra=["--pending-put-timeout-ms", "1000"])
    srv = cluster.servers[0]
    addr, pid = srv.address, srv.proc.pid
    sizes = write_oracle(addr, token)
    warm_up(addr, token)
    assert_serving(cluster, token)
    time.sleep(0.5)  # the probe client's connection threads wind down
    threads0 = proc_status(pid, "Threads")
    rss0 = rss_bytes(pid)
    evictions0 = stats_of(addr, token)["evictions"]
    ran = [0]
    seen: Counter[str] = Counter()  # replies by op and status: what the run reached

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(examples())
    def fuzz(ex: Example) -> None:
        ran[0] += 1
        assert srv.alive, "server process died"
        replies = exchange(addr, ex, token)
        check_exchange(ex, token, replies, sizes)
        seen.update(f"{Op.NAMES.get(r.opcode, r.opcode)}:{Status(r.status).name}"
                    for r in replies)

    t0 = time.monotonic()
    fuzz()
    took = time.monotonic() - t0

    assert srv.alive, "server process died"
    assert_serving(cluster, token)
    s = stats_of(addr, token)
    check_oracle(addr, token, sizes, s["evictions"] - evictions0)

    def settled() -> dict | None:
        s = stats_of(addr, token)
        return s if (s["shm_leases"], s["shm_slots"], s["pending_puts"]) == (0, 0, 0) else None

    s = wait_for(settled, 8) or stats_of(addr, token)
    assert (s["shm_leases"], s["shm_slots"], s["pending_puts"]) == (0, 0, 0), s
    threads = wait_for(lambda: (n := proc_status(pid, "Threads")) <= threads0 + 2 and n, 10)
    assert threads, f"threads {proc_status(pid, 'Threads')} vs {threads0} before the run"
    rss = rss_bytes(pid)
    assert rss - rss0 < 64 * MIB, f"RSS grew {(rss - rss0) / MIB:.1f} MiB over the run"
    log = server_log(cluster)
    assert "Traceback" not in log, log[-4000:]
    print(f"\nfuzz[{'token' if token else 'no-token'}]: {ran[0]} examples in {took:.1f}s, "
          f"RSS {rss0 / MIB:.0f} -> {rss / MIB:.0f} MiB, threads {threads0} -> {threads}, "
          f"evictions {s['evictions'] - evictions0}\n  replies: {sorted(seen.items())}")

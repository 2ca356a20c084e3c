"""A co-located (shm) client cannot change the arena's bytes.

Before the fix the SDK mapped the arena file MAP_SHARED read-write and wrote puts into
ALLOC'ed chunks itself, so any same-uid client could overwrite every namespace's
committed objects. Now it maps the arena read-only, puts go through its own staging
file (PUT_STAGED: the server copies, verifies the writer's checksum, publishes), ALLOC
is refused unless the server trusts its writers, and ``--shm-group`` lets clients of
another uid read (never write) the arena. Real server processes throughout.
"""

from __future__ import annotations

import grp
import os
import stat
import time

import numpy as np
import pytest

from gcache import native, staging
from gcache.credentials import parse_client_credential
from gcache.hashing import checksum
from gcache.protocol import Limits, Op
from gcache.sdk import Client, Status
from gcache.sdk.transports import onesided, shm
from gcache.sdk.transports.shm import ShmTransport, _Staging
from gcache.testing.oracle import value_for

pytestmark = [pytest.mark.integration]

SA, SR = "a" * 24, "r" * 24
CREDS = f"""
[[credential]]
id = "team-a"
secret = "{SA}"
grants = [{{ namespaces = "team-a/*", rights = ["read", "write"] }}]

[[credential]]
id = "reader"
secret = "{SR}"
grants = [{{ namespaces = "team-a/*", rights = ["read", "write"] }},
          {{ namespaces = "team-b/*", rights = ["read"] }}]
"""


@pytest.fixture
def srv(make_cluster):
    return make_cluster(1, "96MiB", slab="8MiB")


def _raw(addr: str, cred: str = "") -> ShmTransport:
    t = ShmTransport(addr, parse_client_credential(cred) if cred else "", Limits(), 2.0,
                     "shm")
    t.connect(time.monotonic() + 5)
    assert t.kind == "shm"
    return t


def _arena_perms(path: str) -> set[str]:
    """The protections of this process's mappings of ``path`` (from /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return {ln.split()[1] for ln in f if ln.rstrip().endswith(path)}


def _staged(t: ShmTransport, ns: bytes, items: list, stage: _Staging | None = None,
            name: str | None = None, key: bytes | None = None) -> dict:
    """Write ``items`` ([key, value, csum]) into a staging file, send one PUT_STAGED."""
    if stage is None:
        stage = _Staging(t.auth_reply["shm"]["path"], t.auth_reply["shm"]["uid"],
                         t.shm.map.gid, 1 << 20)
    pos = staging.HEADER_BYTES
    for _k, v, _c in items:
        if pos + len(v) <= len(stage.mm):  # (a too-small file on purpose: not written)
            stage.mm[pos:pos + len(v)] = v
        pos += len(v)
    meta = {"ns": ns, "stage": stage.name if name is None else name,
            "skey": stage.key if key is None else key,
            "items": [[k, len(v), 0, len(v), 0, c] for k, v, c in items]}
    try:
        return t.call(Op.PUT_STAGED, meta, time.monotonic() + 5)
    finally:
        stage.close()


def test_sdk_maps_the_arena_read_only(srv):
    with Client(srv.addresses, transport="shm", timeout_ms=10_000) as c:
        v = value_for(b"ro", 1 << 20)
        assert c.put("ro", v) == Status.OK and c.get("ro") == v  # mapped now
        t = _raw(srv.addresses[0])
        path = t.auth_reply["shm"]["path"]
        perms = _arena_perms(path)
        assert perms and all(p.startswith("r-") for p in perms), perms  # PROT_READ only
        with pytest.raises(TypeError):
            t.shm.map.mm[t.shm.span[0]:t.shm.span[0] + 4] = b"evil"
        t.close()
    # no staging file outlives its connection's first put
    prefix = staging.name_prefix(path)
    assert not [f for f in os.listdir(os.path.dirname(path)) if f.startswith(prefix)]


def test_shm_puts_round_trip_byte_exact_staged(srv):
    before = dict(onesided.STATS)
    sizes = [1, 4095, 65536, (1 << 20) + 3, (3 << 20) + 7]  # 3 MiB: sliced at 1 MiB
    keys = [f"v{n}" for n in sizes]
    with Client(srv.addresses, namespace="shm-put", transport="shm", timeout_ms=10_000,
                slice_bytes=1 << 20) as c:
        vals = [value_for(k.encode(), n) for k, n in zip(keys, sizes)]
        for k, v in zip(keys, vals):
            assert c.put(k, v) == Status.OK
        assert c.get_batch(keys) == vals
        # a batch straight from numpy buffers, over several staging frames (64 x 1 MiB)
        big = [f"b{i}" for i in range(70)]
        arrs = [np.frombuffer(value_for(k.encode(), 1 << 20), np.uint8) for k in big]
        assert c.put_batch_from(big, arrs) == [Status.OK] * 70
        outs = [np.zeros(1 << 20, np.uint8) for _ in big]
        assert c.get_batch_into(big, outs) == [Status.OK] * 70
        assert all(np.array_equal(a, b) for a, b in zip(arrs, outs))
    d = {k: onesided.STATS[k] - before[k] for k in before}
    assert d["shm_put_items"] >= 70 and d["tcp_fallback_items"] == 0, d
    assert d["shm_staged_frames"] >= 2, d  # 70 MiB: more than one 64 MiB staging frame


def test_alloc_is_refused_to_shm_clients(srv):
    t = _raw(srv.addresses[0])
    rep = t.call(Op.ALLOC, {"ns": b"default", "items": [
        [b"a", 4, 0, 4, 0, checksum(b"abcd")]]}, time.monotonic() + 5)
    assert rep["one_sided"] is False and rep["items"][0][0] == Status.AUTH
    assert "shm-trusted-writers" in rep["error"]
    t.close()


def test_staged_put_with_wrong_checksum_publishes_nothing(srv):
    t = _raw(srv.addresses[0])
    v = os.urandom(200_000)
    rep = _staged(t, b"default", [(b"bad", v, checksum(v) ^ 1), (b"good", v, checksum(v))])
    assert rep["st"] == [Status.CORRUPT, Status.OK]
    t.close()
    with Client(srv.addresses, transport="tcp") as c:
        assert c.get("bad") is None and c.exists("bad") is False
        assert c.get("good") == v


def test_credential_without_write_cannot_publish_through_staging(make_cluster, tmp_path):
    creds = tmp_path / "creds.toml"
    creds.write_text(CREDS)
    cl = make_cluster(1, "64MiB", token="legacy-token-0123456789",
                      extra=["--credentials-file", str(creds)])
    addr = cl.addresses[0]
    t = _raw(addr, f"reader:{SR}")  # may write team-a/*, only read team-b/*
    v = os.urandom(300_000)
    assert _staged(t, b"team-b/m", [(b"k", v, checksum(v))])["st"] == [Status.AUTH]
    assert _staged(t, b"team-a/m", [(b"k", v, checksum(v))])["st"] == [Status.OK]
    t.close()
    with Client([addr], namespace="team-b/m", credential=f"reader:{SR}",
                transport="shm", timeout_ms=5000) as c:
        assert c.put("k2", v) == Status.AUTH  # the SDK's own staged path, too
        assert c.get("k") is None and c.get("k2") is None
    with Client([addr], namespace="team-a/m", credential=f"team-a:{SA}",
                transport="shm", timeout_ms=5000) as c:
        assert c.get("k") == v


def test_bad_staging_files_are_refused_and_the_server_keeps_serving(srv, tmp_path):
    addr = srv.addresses[0]
    t = _raw(addr)
    path = t.auth_reply["shm"]["path"]
    shm_dir = os.path.dirname(path)
    v = os.urandom(8192)
    item = [(b"x", v, checksum(v))]

    def refused(rep: dict, why: str) -> None:
        assert rep["staged"] is False and rep["st"] == [Status.BAD_REQUEST], rep
        assert why in rep["error"], rep["error"]

    def mk(capacity: int = 1 << 20) -> _Staging:
        return _Staging(path, t.auth_reply["shm"]["uid"], t.shm.map.gid, capacity)

    # every refusal is a normal reply: the same connection goes on to the next case
    s = mk()  # a symlink (to a real staging file) in the arena's directory
    link = os.path.join(shm_dir, staging.new_name(path))
    os.symlink(s.path, link)
    try:
        refused(_staged(t, b"default", item, s, name=os.path.basename(link)), "symlink")
    finally:
        os.unlink(link)
    # another directory: a path, not a bare name
    refused(_staged(t, b"default", item, mk(), name=str(tmp_path / "x")), "bare file name")
    # another arena's prefix
    refused(_staged(t, b"default", item, mk(), name="gcache-other.stage-" + "0" * 32),
            "bare file name")
    # the wrong key: a client must be able to read a staging file to have it read
    refused(_staged(t, b"default", item, mk(), key=b"k" * 16), "key")
    # too small for the frame
    refused(_staged(t, b"default", item, mk(100)), "too small")
    # readable by others
    s = mk()
    os.chmod(s.path, 0o644)
    refused(_staged(t, b"default", item, s), "others")
    # a hard link (two names)
    s = mk()
    hard = os.path.join(shm_dir, staging.new_name(path))
    os.link(s.path, hard)
    try:
        refused(_staged(t, b"default", item, s), "links")
    finally:
        os.unlink(hard)
    # a FIFO with a staging name: refused at once (never blocks the server)
    fifo = os.path.join(shm_dir, staging.new_name(path))
    os.mkfifo(fifo, 0o600)
    try:
        refused(_staged(t, b"default", item, mk(), name=os.path.basename(fifo)),
                "regular file")
    finally:
        os.unlink(fifo)
    # nothing was published, and a good staging file still works on this connection
    assert _staged(t, b"default", item)["st"] == [Status.OK]
    t.close()
    with Client([addr], transport="tcp") as c:
        assert c.get("x") == v


def test_client_of_another_uid_reads_through_the_arena_group(make_cluster, monkeypatch):
    """--shm-group: the arena is 0640 with that group, and the SDK accepts an arena it
    can open read-only although another uid owns it (this process plays that uid)."""
    gid = os.getgid()
    name = grp.getgrgid(gid).gr_name
    cl = make_cluster(1, "64MiB", extra=["--shm-group", name])
    addr = cl.addresses[0]
    t = ShmTransport(addr, "", Limits(), 2.0, "auto")
    t.connect(time.monotonic() + 5)
    path = t.auth_reply["shm"]["path"]
    t.close()
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_gid == gid
    monkeypatch.setattr(shm.os, "getuid", lambda: st.st_uid + 12345)
    v = os.urandom(600_000)
    before = onesided.STATS["shm_staged_frames"]
    with Client([addr], transport="shm", timeout_ms=10_000) as c:
        assert c.put("other-uid", v) == Status.OK  # staged: file 0640 with the group
        assert c.get("other-uid") == v
    assert onesided.STATS["shm_staged_frames"] == before + 1


@pytest.mark.timeout(60)
def test_staging_file_shrunk_after_validation_refuses_only_the_values_past_its_end(srv):
    """The server validates a staging file once per connection, then reads each frame's
    values from it: a client that truncates its file afterwards gets BAD_REQUEST for
    each value the file no longer holds, the values before stand, nothing torn is
    published and the connection keeps serving (the server has the file mapped: the
    cut faults there, and the copy's guard answers it)."""
    t = _raw(srv.addresses[0])
    stage = _Staging(t.auth_reply["shm"]["path"], t.auth_reply["shm"]["uid"], t.shm.map.gid,
                     1 << 20)
    v1, v2, v3 = os.urandom(1000), os.urandom(200_000), os.urandom(5000)
    pos = staging.HEADER_BYTES
    for v in (v1, v2, v3):
        stage.mm[pos:pos + len(v)] = v
        pos += len(v)

    def frame(rid_items: list) -> dict:
        meta = {"ns": b"default", "stage": stage.name, "skey": stage.key,
                "items": [[k, len(v), 0, len(v), 0, checksum(v)] for k, v in rid_items]}
        return t.call(Op.PUT_STAGED, meta, time.monotonic() + 5)

    assert frame([(b"first", v1)])["st"] == [Status.OK]  # validated and kept open
    # the native copy reads from a mapping of the file (so the cut below faults in the
    # server, and its guard must turn that into short reads); the twin preads
    with open(f"/proc/{srv.servers[0].proc.pid}/maps") as f:
        mapped = any(ln.rstrip().endswith(stage.path) for ln in f)
    assert mapped == (native.ACTIVE == "native")
    os.truncate(stage.path, staging.HEADER_BYTES + 1000 + 100_000)  # v2 cut in half
    rep = frame([(b"one", v1), (b"two", v2), (b"three", v3)])
    assert rep["st"] == [Status.OK, Status.BAD_REQUEST, Status.BAD_REQUEST], rep
    stage.close()
    t.close()
    with Client(srv.addresses, transport="tcp") as c:
        assert c.get("one") == v1 and c.get("first") == v1
        assert c.get("two") is None and c.get("three") is None
        assert c.put("after", v3) == Status.OK and c.get("after") == v3


def test_staged_frame_read_in_groups_settles_each_value_on_its_own(srv):
    """A PUT_STAGED frame larger than the server's read group (STAGED_GROUP_BYTES) is
    read and published group by group: a value whose staged bytes do not match its
    checksum is CORRUPT wherever it sits, values the truncated file no longer holds are
    BAD_REQUEST, a key sent twice keeps its later value, and every other value reads
    back byte-exact."""
    from gcache.server.shm_ops import STAGED_GROUP_BYTES

    t = _raw(srv.addresses[0])
    n, size = 48, 64 << 10
    assert n * size > 2 * STAGED_GROUP_BYTES  # at least three groups
    stage = _Staging(t.auth_reply["shm"]["path"], t.auth_reply["shm"]["uid"], t.shm.map.gid,
                     n * size)
    keys = [b"grp/%d" % i for i in range(n)]
    keys[20] = keys[3]  # sent twice: the later value stands
    values = [os.urandom(size) for _ in range(n)]
    items, pos = [], staging.HEADER_BYTES
    for k, v in zip(keys, values):
        stage.mm[pos:pos + size] = v
        items.append([k, size, 0, size, 0, checksum(v)])
        pos += size
    bad = {5, 30}  # one in the first group, one in a later one
    for i in bad:
        at = staging.HEADER_BYTES + i * size + 100
        stage.mm[at] ^= 0xFF
    meta = {"ns": b"default", "stage": stage.name, "skey": stage.key, "items": items[:1]}
    assert t.call(Op.PUT_STAGED, meta, time.monotonic() + 10)["st"] == [Status.OK]
    os.truncate(stage.path, staging.HEADER_BYTES + (n - 2) * size + 10)  # cuts the last two
    rep = t.call(Op.PUT_STAGED, {**meta, "items": items}, time.monotonic() + 10)
    want = [Status.CORRUPT if i in bad else Status.BAD_REQUEST if i >= n - 2 else Status.OK
            for i in range(n)]
    assert rep["st"] == want, rep
    stage.close()
    t.close()
    with Client(srv.addresses, transport="tcp") as c:
        got = c.get_batch(keys)
        for i, v in enumerate(values):
            if i == 3:
                assert got[i] == values[20]
            elif i in bad or i >= n - 2:
                assert got[i] is None, i
            else:
                assert got[i] == v, i

"""KV events from real gcache-server processes, received by a real ZMQ SUB socket and
decoded with vLLM 0.33.0's own classes (``vllm.distributed.kv_events``): puts, deletes,
eviction and demotion give BlockStored / BlockRemoved with the tier's medium; each
topic is numbered so a gap shows; replay and snapshot resync a subscriber."""

from __future__ import annotations

import contextlib
import sys
import time
import types

import msgspec
import pytest
import zmq

from gcache.sdk import Client, Status
from gcache.testing.cluster import ServerProc, free_port
from gcache.testing.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

END_SEQ = -1
SNAPSHOT_SEQ = -2


def _vllm_kv_events() -> types.ModuleType:
    """vLLM's ``kv_events`` module. Its import pulls ``vllm.v1.core.kv_cache_utils`` for
    one alias (``ExternalBlockHash = bytes | int``), and that module's imports need an
    ``openai`` newer than the ``openai==2.8.0`` the SGLang tests pin: when that import
    fails, the same vLLM file is loaded with the alias given (nothing else replaced)."""
    try:
        import vllm.distributed.kv_events as kv
        return kv
    except ImportError:
        for m in [m for m in sys.modules if m.startswith("vllm.v1.core.kv_cache_utils")
                  or m == "vllm.distributed.kv_events"]:
            del sys.modules[m]
        import vllm.v1.core  # noqa: F401  (the package, without the heavy module)

        alias = types.ModuleType("vllm.v1.core.kv_cache_utils")
        alias.ExternalBlockHash = bytes | int  # type: ignore[attr-defined]
        sys.modules["vllm.v1.core.kv_cache_utils"] = alias
        import vllm.distributed.kv_events as kv
        return kv


@pytest.fixture(scope="module")
def vkv():
    return _vllm_kv_events()


class Subscriber:
    """A router's side: SUB on a server's topics, vLLM's decoder, gap tracking."""

    def __init__(self, vkv, endpoint: str, topics: list[bytes], replay: str = "") -> None:
        self.vkv = vkv
        self.decoder = msgspec.msgpack.Decoder(type=vkv.KVEventBatch)
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        for t in topics:
            self.sub.setsockopt(zmq.SUBSCRIBE, t)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.last: dict[bytes, int] = {}
        self.gaps: list[tuple[bytes, int, int]] = []  # (topic, expected, got)

    def close(self) -> None:
        self.sub.close(linger=0)

    def recv(self, timeout_s: float = 0.3) -> list[tuple[bytes, int, object]]:
        """Frames that arrive within ``timeout_s`` of quiet, decoded."""
        out = []
        while self.sub.poll(int(timeout_s * 1000)):
            topic, seq_b, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if topic in self.last and seq != self.last[topic] + 1:
                self.gaps.append((topic, self.last[topic] + 1, seq))
            self.last[topic] = seq
            out.append((topic, seq, self.decoder.decode(payload)))
        return out

    def request(self, start: int, topic: bytes | None = None, timeout_s: float = 5.0
                ) -> list[tuple[bytes, int, object]]:
        """A replay (``start`` >= 0) or snapshot (``SNAPSHOT_SEQ``) request, as vLLM's
        replay clients send it (an empty delimiter, then the 8-byte start)."""
        d = self.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(self.replay_endpoint)
        try:
            msg = [b"", start.to_bytes(8, "big", signed=True)] + ([topic] if topic else [])
            d.send_multipart(msg)
            out = []
            end = time.monotonic() + timeout_s
            while True:
                left = end - time.monotonic()
                assert left > 0 and d.poll(int(left * 1000)), "no end marker in time"
                _, topic_r, seq_b, payload = d.recv_multipart()
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == END_SEQ and topic_r == b"":
                    return out
                out.append((topic_r, seq, self.decoder.decode(payload)))
        finally:
            d.close(linger=0)


def _events(frames, kind, medium=None):
    """(topic, key) for each block of each ``kind`` event (of ``medium``) in ``frames``."""
    return [(t, h) for t, _s, b in frames for e in b.events if isinstance(e, kind)
            and (medium is None or e.medium == medium) for h in e.block_hashes]


def _start(name: str, tmp_path, extra: list[str], memory: str = "16MiB") -> tuple:
    pub, rep = free_port(), free_port()
    srv = ServerProc(name, memory, slab="1MiB", log_dir=str(tmp_path), extra=[
        "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
        "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rep}", *extra])
    srv.start()
    return srv, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"


def _connected(sub: Subscriber, client: Client, probe: bytes) -> None:
    """Wait out ZMQ's slow joiner: put ``probe`` until its BlockStored arrives."""
    end = time.monotonic() + 10
    while time.monotonic() < end:
        assert client.put(probe, b"p") == Status.OK
        if any(h == probe for _t, h in _events(sub.recv(0.2), sub.vkv.BlockStored)):
            return
    raise AssertionError("the subscriber never received the probe's BlockStored")


@contextlib.contextmanager
def _session(vkv, server: tuple, ns: str, timeout_ms: int = 5000):
    """A subscriber of ``ns``'s topic on ``server`` (``_start``'s triple), connected, and
    a client of that namespace: yields (server, topic, subscriber, client)."""
    srv, pub, rep = server
    topic = f"kv@{srv.name}@{ns}".encode()
    sub = Subscriber(vkv, pub, [topic, f"kv@{srv.name}@*".encode()], rep)
    try:
        with Client([srv.address], namespace=ns, timeout_ms=timeout_ms) as c:
            _connected(sub, c, f"probe-{ns}".encode())
            yield srv, topic, sub, c
    finally:
        sub.close()


@pytest.fixture(scope="module")
def tiered(tmp_path_factory):
    """One server with a 16 MiB memory tier and an NVMe tier, events and replay on."""
    tmp = tmp_path_factory.mktemp("kvev")
    name = f"kvev-t-{time.monotonic_ns() % 10**8}"
    srv, pub, rep = _start(name, tmp, ["--disk-dir", str(tmp / "disk"), "--disk", "256MiB",
                                        "--segment-bytes", "4MiB", "--promote-policy", "never"])
    yield srv, pub, rep
    srv.terminate()
    srv.remove_arena()


def test_put_and_delete_give_block_stored_and_removed_with_memory_medium(vkv, tiered):
    with _session(vkv, tiered, "ns-a") as (_srv, topic, sub, c):
        keys = [f"blk-{i}".encode() for i in range(5)]
        assert c.put_batch(keys, [b"x" * 1000] * 5) == [Status.OK] * 5
        frames = sub.recv()
        assert {h for _t, h in _events(frames, vkv.BlockStored, "CPU")} >= set(keys)
        assert all(t == topic for t, _s, _b in frames)
        ev = next(e for _t, _s, b in frames for e in b.events
                  if isinstance(e, vkv.BlockStored) and e.block_hashes == [keys[0]])
        assert ev.parent_block_hash is None and ev.token_ids == [] and ev.medium == "CPU"
        assert c.delete(keys[1]) == Status.OK
        frames = sub.recv()
        assert _events(frames, vkv.BlockRemoved, "CPU") == [(topic, keys[1])]
        assert not sub.gaps


def test_a_put_naming_its_chain_parent_gives_parent_block_hash(vkv, tiered):
    """A batch put with ``chain_parent`` (the vLLM connector and SGLang plugin send one):
    each BlockStored names the key before it, the chain's head none; a router can walk
    the chain as it does vLLM's own events."""
    with _session(vkv, tiered, "ns-chain") as (_srv, _topic, sub, c):
        keys = [f"chain-{i}".encode() for i in range(4)]
        assert c.put_batch(keys, [b"y" * 500] * 4, chain_parent=b"") == [Status.OK] * 4
        more = [b"chain-4", b"chain-5"]
        assert c.put_batch(more, [b"z" * 500] * 2, chain_parent=keys[-1]) == [Status.OK] * 2
        parents = {e.block_hashes[0]: e.parent_block_hash for _t, _s, b in sub.recv()
                   for e in b.events if isinstance(e, vkv.BlockStored)}
        want = [None] + keys[:-1] + [keys[-1], more[0]]
        assert [parents.get(k, "missing") for k in keys + more] == want


def test_demotion_gives_removed_from_memory_and_stored_on_storage(vkv, tiered):
    with _session(vkv, tiered, "ns-d", 10_000) as (_srv, _topic, sub, c):
        keys = [f"d-{i}".encode() for i in range(40)]  # 40 x 512 KiB > 16 MiB memory
        frames = []
        for a in range(0, 40, 8):
            assert c.put_batch(keys[a:a + 8], [b"v" * (512 << 10)] * 8) == [Status.OK] * 8
            frames += sub.recv(0.05)
        wait_for(lambda: frames.extend(sub.recv(0.2)) or
                 {h for _t, h in _events(frames, vkv.BlockStored, "STORAGE")} & set(keys),
                 timeout=10)
        frames += sub.recv(0.5)
        on_disk = {h for _t, h in _events(frames, vkv.BlockStored, "STORAGE")}
        left_memory = {h for _t, h in _events(frames, vkv.BlockRemoved, "CPU")}
        assert on_disk & set(keys) and on_disk <= set(keys) | {b"probe-ns-d"}
        assert on_disk <= left_memory  # every demoted key left the memory tier
        assert not sub.gaps


def test_replay_resends_a_topics_frames_and_snapshot_lists_what_is_resident(vkv, tiered):
    with _session(vkv, tiered, "ns-r") as (srv, topic, sub, c):
        keys = [f"r-{i}".encode() for i in range(6)]
        for k in keys:
            assert c.put(k, b"y" * 100) == Status.OK
        assert c.delete(keys[0]) == Status.OK
        live = sub.recv()
        replay = sub.request(1, topic)
        # every live frame is in the replay, the same seq and the same events
        by_seq = {s: b for t, s, b in replay}
        assert [s for _t, s, _b in replay] == sorted(by_seq) and replay[0][1] == 1
        for t, s, b in live:
            assert t == topic and by_seq[s] == b
        snap = sub.request(SNAPSHOT_SEQ, topic)
        assert isinstance(snap[0][2].events[0], vkv.AllBlocksCleared)
        assert {s for _t, s, _b in snap} == {sub.last[topic]}  # where to resume
        assert {h for _t, h in _events(snap, vkv.BlockStored, "CPU")} == (
            set(keys[1:]) | {b"probe-ns-r"})
        # the start of this incarnation, in the server topic's replay
        start = sub.request(0, f"kv@{srv.name}@*".encode())
        assert start[0][1] == 1 and isinstance(start[0][2].events[0], vkv.AllBlocksCleared)
        # bad requests get the end marker alone
        assert sub.request(SNAPSHOT_SEQ, b"kv@someone-else@ns-r") == []


def test_memory_eviction_gives_removed_and_queue_overflow_shows_a_gap(vkv, tmp_path):
    """Memory only, a 4-event queue: a burst of puts overflows it. The subscriber sees
    a seq gap (not a silent loss), the counter says how many, a snapshot resyncs."""
    name = f"kvev-g-{time.monotonic_ns() % 10**8}"
    server = _start(name, tmp_path, ["--kv-events-queue-events", "4"], memory="8MiB")
    try:
        with _session(vkv, server, "ns-g") as (srv, topic, sub, c):
            keys = [f"g-{i}".encode() for i in range(64)]  # 64 x 256 KiB = 2x the arena
            assert c.put_batch(keys, [b"z" * (256 << 10)] * 64) == [Status.OK] * 64
            assert c.put(b"after", b"1") == Status.OK
            time.sleep(0.1)
            assert c.put(b"after2", b"1") == Status.OK
            frames = sub.recv(0.5)
            assert sub.gaps, "events were dropped but no seq gap showed"
            dropped = c.stats()[srv.address]["kv_events_dropped"]
            assert dropped > 0
            # the arena is full: each put now evicts; one at a time fits the queue
            for i in range(4):
                assert c.put(f"late-{i}".encode(), b"w" * (256 << 10)) == Status.OK
                frames += sub.recv(0.1)
            evicted = {h for _t, h in _events(frames, vkv.BlockRemoved, "CPU")}
            assert evicted and not evicted & {b"late-3", b"after2"}
            snap = sub.request(SNAPSHOT_SEQ, topic)
            resident = {h for _t, h in _events(snap, vkv.BlockStored, "CPU")}
            assert b"after2" in resident and len(resident) < len(keys)  # some were evicted
    finally:
        server[0].terminate()
        server[0].remove_arena()


def test_restart_announces_all_blocks_cleared_then_what_it_recovered(vkv, tmp_path):
    """A restarted server starts its topics again at seq 1: AllBlocksCleared on
    ``kv@<server>@*``, then a BlockStored for each object the arena kept (in the replay
    buffer, so a router that connects late still gets them)."""
    name = f"kvev-s-{time.monotonic_ns() % 10**8}"
    srv, pub, rep = _start(name, tmp_path, [], memory="8MiB")
    try:
        keys = [f"s-{i}".encode() for i in range(3)]
        with Client([srv.address], namespace="ns-s", timeout_ms=5000) as c:
            assert c.put_batch(keys, [b"q" * 100] * 3) == [Status.OK] * 3
        srv.restart()
        sub = Subscriber(vkv, pub, [], rep)
        try:
            start = sub.request(1, f"kv@{name}@*".encode())
            assert [type(e) for _t, _s, b in start for e in b.events] == [vkv.AllBlocksCleared]
            ns_topic = f"kv@{name}@ns-s".encode()
            announced = wait_for(lambda: sub.request(1, ns_topic), timeout=5)
            assert announced[0][1] == 1
            assert {h for _t, h in _events(announced, vkv.BlockStored, "CPU")} == set(keys)
        finally:
            sub.close()
    finally:
        srv.terminate()
        srv.remove_arena()


def test_leader_master_publishes_all_blocks_cleared_for_a_server_marked_down(vkv, tmp_path):
    """A dead server publishes nothing: the leader's failure detector, once its
    ``mark_down`` committed, publishes AllBlocksCleared on ``kv@<server>@*`` (in
    process: a real one-master Raft group and detector on virtual time, a real SUB)."""
    from gcache.clock import VirtualClock
    from gcache.master.detector import FailureDetector
    from gcache.master.down_events import DownPublisher
    from gcache.master.raft_node import RaftNode
    from gcache.testing.cluster import free_port_pair

    node = RaftNode(f"127.0.0.1:{free_port_pair()}", [], str(tmp_path / "raft"), "test-secret")
    pub = DownPublisher(f"tcp://127.0.0.1:{free_port()}")
    sub = Subscriber(vkv, pub.endpoint, [b"kv@s1@*", b"kv@s2@*"])
    try:
        wait_for(lambda: node.is_leader, 20.0)
        for mid in ("s1", "s2"):
            node.submit({"op": "register", "id": mid, "address": "127.0.0.1:1",
                         "capacity_bytes": 1 << 20, "boot_id": f"boot-{mid}"})
        clock = VirtualClock()
        det = FailureDetector(node, 3.0, clock, on_down=pub.member_gone)
        assert det.step() == []
        time.sleep(0.3)  # ZMQ's slow joiner: the subscription reaches the PUB socket
        clock.advance(3.0)
        det.seen("s1")  # s1 heartbeats; s2 stays silent
        clock.advance(0.5)
        assert det.step() == ["s2"]
        frames = sub.recv(0.5)
        assert [(t, s) for t, s, _b in frames] == [(b"kv@s2@*", 1)]
        assert [type(e) for e in frames[0][2].events] == [vkv.AllBlocksCleared]
    finally:
        sub.close()
        pub.close()
        node.close()

"""The ``nixl`` transport: one-sided READ/WRITE against the server's registered arena.

Design. The server registers its whole arena with a NIXL agent (UCX backend) and
sends that agent's metadata, the arena's base address and bounds in the AUTH reply
(server/nixl_ops.py). The client keeps one NIXL agent per process, adds each
server's agent as a remote once (reference counted). ``NixlPath`` is then the
``DataPath`` of a ``OneSidedTransport`` (onesided.py: LEASE -> READ -> RELEASE,
ALLOC -> WRITE -> COMMIT) that moves bytes by NIXL transfers:

* a frame's copies are posted as one NIXL transfer per memory type (one descriptor
  per slice), so a batch costs one post and one completion, not one per key;
* a destination or source inside memory registered with ``register_buffer`` (host
  memory, or a CUDA tensor where CUDA exists: GPUDirect when the NIC supports it)
  moves with no copy on this host; anything else is staged through this
  connection's registered bounce buffer (``nixl_bounce_bytes``) in rounds;
* the transfer is polled until done or the deadline: a timed-out transfer is
  released (cancelled by NIXL); a transfer NIXL cannot cancel leaves its bounce
  buffer quarantined (never reused or freed) and the connection closed.

Over UCX this is RDMA/GPUDirect where a NIC exists and CMA (process_vm_readv/writev)
or TCP between processes of one host here; tests run it with ``UCX_NET_DEVICES=lo``.

Mode ``auto`` prefers the shm mapping when the server is co-located, then nixl when
the server offers it, then TCP; ``make_transport`` only builds this class for
``auto`` when the host has an RDMA device, so a plain host never loads NIXL.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from typing import Any

import numpy as np

from gcache.config import TransportKind
from gcache.nixl_lib import Agent, NixlUnavailable
from gcache.credentials import ClientCredential
from gcache.protocol import Limits
from gcache.sdk.buffers import DeviceView, address_of, as_view, memmove
from gcache.sdk.transports.base import TransportTimeout
from gcache.sdk.transports.onesided import STATS, Copy, DataPath, OneSidedTransport
from gcache.sdk.transports.shm import ShmPath

log = logging.getLogger("gcache.sdk.nixl")

_agent: Agent | None = None
_agent_lock = threading.Lock()
_quarantine: list[Any] = []  # bounce buffers a transfer may still write: never freed
_told: set[str] = set()  # servers whose "nixl not used" was logged


def process_agent() -> Agent:
    """This process's NIXL agent (created on first use; closed at exit or by close_agent)."""
    global _agent
    with _agent_lock:
        if _agent is None or _agent.closed:
            pin_rail()
            _agent = Agent(f"gcache-sdk-{os.getpid()}-{os.urandom(4).hex()}")
        return _agent


def pin_rail(sysfs: str = "/sys") -> str:
    """Before the first agent: point UCX at this process's same-rail NIC (nearest to its
    GPU, GPU NICs before the front-end NIC) unless ``UCX_NET_DEVICES`` is set already."""
    if os.environ.get("UCX_NET_DEVICES"):
        return os.environ["UCX_NET_DEVICES"]
    from gcache.sdk.nic_topology import current_gpu, ucx_net_devices

    devs = ucx_net_devices(current_gpu(), sysfs)
    if devs:
        os.environ["UCX_NET_DEVICES"] = devs
        log.info("nixl: UCX_NET_DEVICES=%s (same rail as this process's GPU)", devs)
    return devs


def close_agent() -> None:
    """Tear the process agent down now (explicitly, not at interpreter exit)."""
    global _agent
    with _agent_lock:
        a, _agent = _agent, None
    REGISTRY.clear()
    if a is not None:
        a.close()


def local_span(local: Any) -> tuple[int, str, int]:
    """(address, NIXL memory type, device) of a destination/source view."""
    if isinstance(local, DeviceView):
        return local.ptr, "VRAM", local.dev
    return address_of(local), "DRAM", 0


class _Registry:
    """Memory the user registered with ``Client.register_buffer``: moves with no copy."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[int, int, str, int, Any, Any]] = []  # start, end, mem, dev, reg, owner

    def add(self, buf: Any) -> bool:
        view = buf if isinstance(buf, DeviceView) else None
        if view is None:
            view = as_view(buf, writable=False, device=True)
        addr, mem, dev = local_span(view)
        n = len(view)
        if not n:
            return False
        with self.lock:
            if any(s[0] == addr and s[1] == addr + n for s in self.spans):
                return True
            reg = process_agent().register(addr, n, mem, dev)
            bisect.insort(self.spans, (addr, addr + n, mem, dev, reg, view),
                          key=lambda s: s[0])
        return True

    def remove(self, buf: Any) -> bool:
        view = buf if isinstance(buf, DeviceView) else None
        if view is None:
            view = as_view(buf, writable=False, device=True)
        addr = local_span(view)[0]
        with self.lock:
            hit = [s for s in self.spans if s[0] == addr]
            for s in hit:
                self.spans.remove(s)
        for s in hit:
            if _agent is not None:
                _agent.deregister(s[4])
        return bool(hit)

    def covers(self, addr: int, n: int, mem: str, dev: int) -> bool:
        with self.lock:
            i = bisect.bisect_right(self.spans, addr, key=lambda s: s[0])
            # every span starting at or before addr (few: long-lived pools), nearest first
            return any(s[2] == mem and s[3] == dev and addr + n <= s[1]
                       for s in reversed(self.spans[:i]))

    def clear(self) -> None:
        with self.lock:
            self.spans.clear()


REGISTRY = _Registry()


class _Round:
    """Transfers of one round: per memory type, local and remote descriptors, plus the
    bounce copies to run before (puts) or after (gets) the transfer."""

    def __init__(self) -> None:
        self.groups: dict[tuple[str, int], tuple[list, list]] = {}
        self.after: list[Any] = []
        self.used = 0

    def add(self, laddr: int, raddr: int, n: int, mem: str, dev: int) -> None:
        loc, rem = self.groups.setdefault((mem, dev), ([], []))
        loc.append((laddr, n, dev))
        rem.append((raddr, n, 0))


class NixlPath(DataPath):
    """The nixl data path of one transport: the server's agent as a remote of this
    process's agent, and this connection's registered bounce buffer."""

    kind = TransportKind.NIXL

    def __init__(self, bounce_bytes: int = 8 << 20) -> None:
        self.bounce_bytes = max(1 << 20, bounce_bytes)
        self.agent: Agent | None = None
        self.remote = ""
        self.rbase = 0
        self.bounce: np.ndarray | None = None
        self.bounce_reg: Any = None

    # ------------------------------------------------------------------ connection
    def attach(self, conn: OneSidedTransport) -> str:
        """Add the server's agent as a remote; '' on success, else why not."""
        auth = conn.auth_reply
        info = auth.get("nixl") if isinstance(auth, dict) else None
        if not isinstance(info, dict):
            return "the server offers no NIXL agent (start gcache-server with --nixl on)"
        try:
            md, base, size = bytes(info["md"]), int(info["base"]), int(info["size"])
            data_off, name = int(info["data_off"]), str(info["agent"])
        except (KeyError, TypeError, ValueError):
            return "the server's NIXL info is malformed"
        self._drop_remote()  # a reconnect: the server may have a new agent
        try:
            self.agent = process_agent()
            remote = self.agent.add_remote(md)
        except NixlUnavailable as exc:
            return str(exc)
        except Exception as exc:  # the backend could not reach the server's agent
            return f"cannot reach its NIXL agent: {exc}"
        if remote != name:
            self.agent.drop_remote(remote)
            return f"NIXL metadata names agent {remote!r}, the server said {name!r}"
        self.remote, self.rbase = remote, base
        self.span = (data_off, size)
        self.lease_s = max(0.05, int(info.get("lease_ms", 10000)) / 1000.0)
        STATS["nixl_connections"] += 1
        return ""

    def close(self) -> None:
        self._drop_remote()

    def release(self) -> None:
        self._drop_remote()
        self._drop_bounce()

    def _drop_remote(self) -> None:
        if self.remote and self.agent is not None:
            self.agent.drop_remote(self.remote)
        self.remote = ""

    def _drop_bounce(self) -> None:
        if self.bounce_reg is not None and self.agent is not None:
            try:
                self.agent.deregister(self.bounce_reg)
            except Exception as exc:
                log.debug("deregister bounce: %s", exc)
        self.bounce, self.bounce_reg = None, None

    def _bounce(self) -> int:
        if self.bounce is None:
            buf = np.empty(self.bounce_bytes, dtype=np.uint8)
            buf.fill(0)  # prefault: first touch inside a transfer is slower
            self.bounce_reg = self.agent.register(int(buf.ctypes.data), len(buf))
            self.bounce = buf
        return int(self.bounce.ctypes.data)

    # ------------------------------------------------------------------ movers
    def move_in(self, conn: OneSidedTransport, copies: list[Copy], t0: float,
                deadline: float) -> None:
        self._run(conn, "READ", copies, t0, deadline)  # hashes nothing: None

    def move_out(self, conn: OneSidedTransport, copies: list[Copy], t0: float,
                 deadline: float) -> None:
        self._run(conn, "WRITE", copies, t0, deadline)

    def _run(self, conn: OneSidedTransport, op: str, moves: list[Copy],
             t0: float, deadline: float) -> None:
        """Post ``moves`` (local view, arena offset, bytes, _) in rounds bounded by the
        bounce."""
        rnd = _Round()
        for local, remote, n, _ in moves:
            addr, mem, dev = local_span(local)
            if REGISTRY.covers(addr, n, mem, dev):
                rnd.add(addr, self.rbase + remote, n, mem, dev)
                continue
            done = 0
            while done < n:  # staged: through the bounce buffer, split if it is larger
                if rnd.used >= self.bounce_bytes:
                    self._post(conn, op, rnd, t0, deadline)
                    rnd = _Round()
                take = min(n - done, self.bounce_bytes - rnd.used)
                baddr = self._bounce() + rnd.used
                rnd.used += take
                rnd.add(baddr, self.rbase + remote + done, take, "DRAM", 0)
                piece = local[done:done + take]
                if op == "WRITE":
                    _to_bounce(piece, baddr, take)
                else:
                    rnd.after.append((piece, baddr, take))
                STATS["nixl_staged_bytes"] += take
                done += take
        if rnd.groups:
            self._post(conn, op, rnd, t0, deadline)

    def _post(self, conn: OneSidedTransport, op: str, rnd: _Round, t0: float,
              deadline: float) -> None:
        conn.copy_window(t0, deadline)
        nx = self.agent.nx
        if nx is None:
            raise ConnectionError("the NIXL agent was closed")
        for (mem, _dev), (loc, rem) in rnd.groups.items():
            ld = nx.get_xfer_descs(loc, mem)
            rd = nx.get_xfer_descs(rem, "DRAM")
            h = nx.initialize_xfer(op, ld, rd, self.remote)
            ok = False
            try:
                st = nx.transfer(h)
                spins = 0
                while st == "PROC":
                    if time.monotonic() >= deadline:
                        raise TransportTimeout()
                    spins += 1
                    time.sleep(0 if spins < 200 else 0.0001)
                    st = nx.check_xfer_state(h)
                if st != "DONE":
                    raise ConnectionError(f"NIXL {op} with {conn.address} failed ({st})")
                ok = True
            finally:
                try:
                    nx.release_xfer_handle(h)
                except Exception as exc:  # still in flight: never reuse what it may write
                    log.warning("NIXL %s with %s could not be cancelled: %s", op,
                                conn.address, exc)
                    if self.bounce is not None:
                        _quarantine.append((self.bounce, self.bounce_reg))
                        self.bounce, self.bounce_reg = None, None
                    ok = False
                if not ok:
                    conn.close()  # leases and slots go with the connection
        for piece, baddr, n in rnd.after:
            _from_bounce(piece, baddr, n)




class NixlTransport(OneSidedTransport):
    """One connection that moves bytes through NIXL (``nixl``); under ``auto`` the shm
    mapping first when co-located, and the plain TCP ops when neither path attaches."""

    def __init__(self, address: str, token: str | ClientCredential, limits: Limits,
                 connect_timeout: float, mode: str = "nixl", bounce_bytes: int = 8 << 20
                 ) -> None:
        if mode not in ("auto", "nixl"):
            raise ValueError(f"NixlTransport mode must be auto or nixl, not {mode!r}")
        self.mode = mode
        self.nixl = NixlPath(bounce_bytes)
        paths = (ShmPath(), self.nixl) if mode == "auto" else (self.nixl,)
        super().__init__(address, token, limits, connect_timeout, paths=paths)

    def no_path(self, why: str) -> None:
        if self.mode == "nixl":
            self.close()
            raise ConnectionError(f"nixl transport to {self.address}: {why}")
        if self.address not in _told:  # once per server, not per connection
            _told.add(self.address)
            log.info("nixl not used for %s: %s; using TCP", self.address, why)


def _to_bounce(src: Any, baddr: int, n: int) -> None:
    if isinstance(src, DeviceView):
        src.to_host(baddr, n)
    else:
        memmove(baddr, address_of(src), n)


def _from_bounce(dst: Any, baddr: int, n: int) -> None:
    if isinstance(dst, DeviceView):
        dst.from_host(baddr, n)
    else:
        memmove(address_of(dst), baddr, n)

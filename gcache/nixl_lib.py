"""Loading NIXL (``nixl-cu12``) and making / tearing down agents, for server and SDK.

NIXL is optional at runtime: ``load()`` imports it lazily and raises
``NixlUnavailable`` with the reason (not installed, no UCX plugin) so callers can
fall back to TCP with one log line. The wheel is installed next to the CPU torch
(``pip install torch==2.13.0 nixl-cu12==1.5.1`` in one command, see the Makefile).

Agents are always torn down explicitly (``Agent.close``): deregister memory, drop
remote agents, then drop the C++ agent while the interpreter is still whole. An
agent left to interpreter exit can crash the process (see the reference notes), so
an ``atexit`` hook closes whatever is still open.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref

from gcache.errors import NixlUnavailable
from typing import Any

log = logging.getLogger("gcache.nixl")

BACKEND = "UCX"


_mod: Any = None
_lock = threading.Lock()


def load() -> Any:
    """The ``nixl_cu12`` module (imported once), or raise ``NixlUnavailable``."""
    global _mod
    if _mod is not None:
        return _mod
    with _lock:
        if _mod is None:
            try:
                import nixl_cu12 as mod  # type: ignore[import-not-found]
            except Exception as exc:  # ImportError, or a broken native library
                raise NixlUnavailable(f"nixl-cu12 is not importable ({exc}); install it with "
                                      "`pip install torch==2.13.0 nixl-cu12==1.5.1`") from None
            _quiet(mod)
            _mod = mod
    return _mod


def _quiet(mod: Any) -> None:
    """NIXL logs every agent and backend creation at INFO on its own handler."""
    if os.environ.get("GCACHE_NIXL_VERBOSE"):
        return
    for name in ("nixl", "nixl_cu12", getattr(mod, "__name__", "")):
        logging.getLogger(name).setLevel(logging.WARNING)


def available() -> str:
    """'' when NIXL can be used here, else why not."""
    try:
        load()
    except NixlUnavailable as exc:
        return str(exc)
    return ""


def rdma_devices(sysfs: str = "/sys") -> list[str]:
    """RDMA devices of this host (``/sys/class/infiniband``); [] when there are none."""
    try:
        return sorted(os.listdir(os.path.join(sysfs, "class", "infiniband")))
    except OSError:
        return []


_open: "weakref.WeakSet[Agent]" = weakref.WeakSet()


class Agent:
    """One NIXL agent with the UCX backend; thread-safe for concurrent transfers."""

    def __init__(self, name: str, progress_s: float = 0.0) -> None:
        mod = load()
        sync = getattr(mod.nixl_thread_sync_t, "NIXL_THREAD_SYNC_RW", None)
        # NIXL's own progress thread busy-polls (the Python API fixes its delay at 0), a
        # whole core per process. Initiators progress by polling their transfers; a
        # target that must progress (UCX tcp emulates RMA with messages) gets a paced
        # thread of ours instead: ``progress_s`` > 0.
        conf = mod.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                     backends=[BACKEND], sync_mode=sync)
        try:
            self.nx = mod.nixl_agent(name, conf)
        except Exception as exc:
            raise NixlUnavailable(f"cannot create a NIXL agent: {exc}") from None
        if BACKEND not in self.nx.backends:
            self.nx = None
            raise NixlUnavailable("NIXL has no UCX backend plugin here")
        self.name = name
        self.lock = threading.Lock()  # registrations and remote-agent bookkeeping
        self.regs: list[Any] = []
        self.remotes: dict[str, int] = {}  # remote agent name -> users
        self._stop = threading.Event()
        self._progress: threading.Thread | None = None
        if progress_s > 0:
            self._progress = threading.Thread(target=self._progress_loop, args=(progress_s,),
                                              name="gcache-nixl-progress", daemon=True)
            self._progress.start()
        _open.add(self)

    def _progress_loop(self, period: float) -> None:
        while not self._stop.wait(period):
            nx = self.nx
            if nx is None:
                return
            try:
                nx.get_new_notifs()  # drives the backend's workers
            except Exception as exc:
                log.debug("nixl progress: %s", exc)

    @property
    def closed(self) -> bool:
        return self.nx is None

    def metadata(self) -> bytes:
        return bytes(self.nx.get_agent_metadata())

    def register(self, addr: int, n: int, mem: str = "DRAM", dev: int = 0) -> Any:
        """Register [addr, addr+n) (``DRAM`` or ``VRAM`` on ``dev``); returns a handle."""
        with self.lock:
            reg = self.nx.register_memory([(addr, n, dev, "")], mem)
            self.regs.append(reg)
            return reg

    def deregister(self, reg: Any) -> None:
        with self.lock:
            if self.nx is None or reg not in self.regs:
                return
            self.regs.remove(reg)
            self.nx.deregister_memory(reg)

    def add_remote(self, md: bytes) -> str:
        with self.lock:
            name = self.nx.add_remote_agent(md)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self.remotes[name] = self.remotes.get(name, 0) + 1
            return name

    def drop_remote(self, name: str) -> None:
        with self.lock:
            left = self.remotes.get(name, 0) - 1
            if left > 0:
                self.remotes[name] = left
                return
            self.remotes.pop(name, None)
            if self.nx is not None:
                try:
                    self.nx.remove_remote_agent(name)
                except Exception as exc:
                    log.debug("remove_remote_agent(%s): %s", name, exc)

    def close(self) -> None:
        """Explicit teardown, in dependency order. Idempotent."""
        self._stop.set()
        if self._progress is not None and self._progress is not threading.current_thread():
            self._progress.join(2.0)
        with self.lock:
            nx, self.nx = self.nx, None
            regs, self.regs = self.regs, []
            remotes, self.remotes = list(self.remotes), {}
        if nx is None:
            return
        for reg in regs:
            try:
                nx.deregister_memory(reg)
            except Exception as exc:
                log.debug("deregister_memory: %s", exc)
        for name in remotes:
            try:
                nx.remove_remote_agent(name)
            except Exception as exc:
                log.debug("remove_remote_agent(%s): %s", name, exc)
        del nx  # the last reference: the C++ agent is destroyed here, not at exit
        _open.discard(self)


@atexit.register
def _close_all() -> None:
    for agent in list(_open):
        try:
            agent.close()
        except Exception:
            pass

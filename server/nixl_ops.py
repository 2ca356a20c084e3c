"""Server side of the ``nixl`` transport: one NIXL agent with the whole arena registered.

Design. The server never moves bytes for a nixl client: the client leases (GET) or
allocates (PUT) through the same control ops as the shm transport (``shm_ops``),
gets arena offsets back, and does one-sided READ/WRITE against the arena that this
module registered with NIXL's UCX backend (RDMA where a NIC exists, CMA or TCP
between processes here). So leases, slots, ownership checks, checksums on COMMIT and
eviction rules are exactly the shm ones.

What a client needs to reach the arena (the agent's metadata, the arena's base
address in this process, its size and data offset) is sent in the AUTH reply, never
in HELLO: the metadata holds the memory keys, so only an authenticated peer gets it.

``--nixl auto`` (the default) starts the agent only when this host has an RDMA device
(``/sys/class/infiniband``) and nixl-cu12 imports; ``on`` requires it (exit with the
reason otherwise); ``off`` never starts it. The agent is torn down explicitly on stop,
before the arena is unmapped.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from gcache.nixl_lib import Agent, NixlUnavailable, load, rdma_devices

log = logging.getLogger("gcache.server.nixl")

# Target-side progress for UCX transports that emulate RMA with messages (tcp); RDMA and
# CMA reads/writes never need it. 1 ms keeps an idle server at ~3 % of a core.
PROGRESS_S = 0.001


class ServerNixl:
    def __init__(self, arena, name: str, lease_ms: int) -> None:
        self.name = f"gcache-{name}-{os.getpid()}-{os.urandom(4).hex()}"
        self.agent = Agent(self.name, progress_s=PROGRESS_S)
        try:
            view = np.frombuffer(arena.mm, dtype=np.uint8)
            self.base = int(view.ctypes.data)
            del view  # no buffer export may outlive this: the arena unmaps on close
            self.agent.register(self.base, arena.size)
            self.info = {"agent": self.name, "md": self.agent.metadata(), "base": self.base,
                         "size": arena.size, "data_off": arena.data_off,
                         "lease_ms": lease_ms}
        except Exception:
            self.agent.close()
            raise

    def close(self) -> None:
        self.agent.close()


def start(mode: str, arena, name: str, lease_ms: int) -> ServerNixl | None:
    """The agent per ``--nixl`` (auto|on|off), or None. ``on`` raises NixlUnavailable.
    ``lease_ms``: the shm registry's lease expiry, told to clients with the metadata."""
    if mode == "off":
        return None
    if mode == "auto":
        devs = rdma_devices()
        if not devs:
            log.info("nixl transport off: no RDMA device on this host (--nixl on forces it)")
            return None
        try:
            load()
        except NixlUnavailable as exc:
            log.info("nixl transport off: %s", exc)
            return None
    nx = ServerNixl(arena, name, lease_ms)
    log.info("nixl transport on", extra={"fields": {"agent": nx.name, "bytes": arena.size}})
    return nx

"""RDMA NIC discovery and GPU -> NIC ("same rail") selection from sysfs (+ pyverbs).

Design. sysfs is the source of truth for placement: each RDMA device under
``/sys/class/infiniband/<dev>`` links to its PCI function, whose resolved path
(``/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/...``) encodes the PCIe
tree. The PCIe distance between a GPU and a NIC is the number of hops from
each to their deepest common ancestor bridge: behind one PCIe switch it is 4
(device -> downstream port -> switch, twice), which is the GPUDirect "rail"
NIC; larger numbers cross the root complex, and devices on different roots are
further still (and usually a NUMA hop).

For each GPU the chooser picks, among NICs with an ACTIVE port, the one with
the smallest (PCIe distance, NUMA mismatch, -link rate). NICs that share a
PCIe root with some GPU are "GPU NICs"; the others (the host's front-end NIC)
are used only when no GPU NIC is up. pyverbs (Debian ``python3-pyverbs``) is
optional: when importable it confirms which devices the verbs stack can open;
``get_device_list()`` raising ``PyverbsRDMAError`` means "no RDMA here". With no
usable device the caller falls back to TCP, logged once.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("gcache.sdk.topology")

_PCI_ADDR = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_NVIDIA = "0x10de"
_GPU_CLASSES = ("0x030000", "0x030200")  # VGA controller, 3D controller


@dataclass(frozen=True, slots=True)
class PciDevice:
    addr: str  # e.g. 0000:3b:00.0
    chain: tuple[str, ...]  # root bus .. the device itself, from the resolved sysfs path
    numa_node: int

    def distance(self, other: PciDevice) -> int:
        common = 0
        for a, b in zip(self.chain, other.chain):
            if a != b:
                break
            common += 1
        if common == 0:  # different PCIe roots (root complexes / sockets)
            return len(self.chain) + len(other.chain) + 2
        return (len(self.chain) - common) + (len(other.chain) - common)


@dataclass(frozen=True, slots=True)
class Nic:
    name: str  # RDMA device name, e.g. mlx5_0
    pci: PciDevice
    port: int
    active: bool
    rate_gbps: float
    netdev: str = ""


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    pci: PciDevice


@dataclass(frozen=True, slots=True)
class Topology:
    nics: tuple[Nic, ...]
    gpus: tuple[Gpu, ...]

    def gpu_nics(self) -> list[Nic]:
        roots = {g.pci.chain[0] for g in self.gpus if g.pci.chain}
        return [n for n in self.nics if n.pci.chain and n.pci.chain[0] in roots]

    def nic_for_gpu(self, gpu: int) -> Nic | None:
        """The nearest ACTIVE NIC to GPU ``gpu`` (same rail first), or None."""
        g = next((x for x in self.gpus if x.index == gpu), None)
        up = [n for n in self.nics if n.active]
        if g is None or not up:
            return None
        gpu_side = {n.name for n in self.gpu_nics()}
        preferred = [n for n in up if n.name in gpu_side] or up
        return min(preferred, key=lambda n: (g.pci.distance(n.pci),
                                             n.pci.numa_node != g.pci.numa_node,
                                             -n.rate_gbps, n.name))

    def rail_map(self) -> dict[int, str]:
        return {g.index: n.name for g in self.gpus if (n := self.nic_for_gpu(g.index))}


def _read(path: Path, default: str = "") -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return default


def _pci_device(sysfs: Path, dev_path: Path) -> PciDevice | None:
    """PCI identity from a sysfs device link (…/device or /sys/bus/pci/devices/ADDR)."""
    try:
        real = Path(os.path.realpath(dev_path))
    except OSError:
        return None
    parts = real.parts
    chain = tuple(p for p in parts if p.startswith("pci") or _PCI_ADDR.match(p))
    if not chain or not _PCI_ADDR.match(chain[-1]):
        return None
    numa = _read(real / "numa_node", "-1")
    try:
        node = int(numa)
    except ValueError:
        node = -1
    return PciDevice(chain[-1], chain, node)


def _rate_gbps(text: str) -> float:
    m = re.match(r"\s*([0-9.]+)\s*Gb/sec", text)
    return float(m.group(1)) if m else 0.0


def verbs_devices() -> set[str] | None:
    """Device names pyverbs can open; None when pyverbs is not installed."""
    try:
        from pyverbs import device as pd  # type: ignore[import-not-found]
        from pyverbs.pyverbs_error import PyverbsRDMAError  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        return {d.name.decode() if isinstance(d.name, bytes) else str(d.name)
                for d in pd.get_device_list()}
    except PyverbsRDMAError:
        return set()


def discover(sysfs: str | os.PathLike = "/sys", *, use_pyverbs: bool = True) -> Topology:
    """Read RDMA NICs and NVIDIA GPUs from a sysfs tree (a real one or a fixture)."""
    root = Path(sysfs)
    allowed = verbs_devices() if use_pyverbs else None
    nics: list[Nic] = []
    ib = root / "class" / "infiniband"
    for dev in sorted(ib.iterdir()) if ib.is_dir() else []:
        if allowed is not None and dev.name not in allowed:
            continue
        pci = _pci_device(root, dev / "device")
        if pci is None:
            continue
        netdevs = sorted(p.name for p in (dev / "device" / "net").glob("*")) \
            if (dev / "device" / "net").is_dir() else []
        for port in sorted((dev / "ports").glob("*"), key=lambda p: p.name):
            state = _read(port / "state")
            nics.append(Nic(dev.name, pci, int(port.name), state.endswith("ACTIVE"),
                            _rate_gbps(_read(port / "rate")), netdevs[0] if netdevs else ""))
    gpus: list[Gpu] = []
    pcidir = root / "bus" / "pci" / "devices"
    found = []
    for d in sorted(pcidir.iterdir()) if pcidir.is_dir() else []:
        if _read(d / "vendor") == _NVIDIA and _read(d / "class")[:8] in _GPU_CLASSES:
            pci = _pci_device(root, d)
            if pci is not None:
                found.append(pci)
    for i, pci in enumerate(sorted(found, key=lambda p: p.addr)):
        gpus.append(Gpu(i, pci))  # CUDA's default order is PCI bus order
    return Topology(tuple(nics), tuple(gpus))


_warned = False


def choose_rdma_nic(gpu: int | None = None, sysfs: str = "/sys") -> Nic | None:
    """The NIC a client on ``gpu`` should use, or None (then use TCP; logged once)."""
    global _warned
    topo = discover(sysfs)
    nic = topo.nic_for_gpu(gpu) if gpu is not None and topo.gpus else \
        next((n for n in topo.gpu_nics() + list(topo.nics) if n.active), None)
    if nic is None and not _warned:
        log.info("no active RDMA device found: using the TCP transport")
        _warned = True
    return nic


def ucx_net_devices(gpu: int | None = None, sysfs: str = "/sys") -> str:
    """``UCX_NET_DEVICES`` for a process on ``gpu``: its same-rail NIC as ``mlx5_N:PORT``,
    or '' when there is none (then UCX/NIXL is not used for RDMA; TCP it is)."""
    nic = choose_rdma_nic(gpu, sysfs)
    return f"{nic.name}:{nic.port}" if nic is not None else ""


def current_gpu() -> int | None:
    """The CUDA device this process works on, if torch is loaded and CUDA is present."""
    import sys

    torch = sys.modules.get("torch")  # never import torch just to ask
    try:
        if torch is not None and torch.cuda.is_available():
            return int(torch.cuda.current_device())
    except Exception:
        pass
    return None

"""Same-rail NIC selection from recorded sysfs trees (no RDMA hardware needed)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from gcache.sdk import nic_topology as nt

pytestmark = pytest.mark.unit

FIXTURE = Path(__file__).parent / "fixtures" / "sysfs_2socket_4gpu.json"


def build_sysfs(root: Path, devices: list[dict]) -> Path:
    """Materialise a recorded layout as a sysfs tree: devices, bus links, infiniband class."""
    for d in devices:
        dev = root / "devices" / d["path"]
        dev.mkdir(parents=True, exist_ok=True)
        (dev / "numa_node").write_text(f"{d['numa']}\n")
        (dev / "vendor").write_text(d["vendor"] + "\n")
        (dev / "class").write_text(d["class"] + "\n")
        addr = d["path"].rsplit("/", 1)[1]
        bus = root / "bus" / "pci" / "devices"
        bus.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(dev, bus), bus / addr)
        if "ib" in d:
            ib = root / "class" / "infiniband" / d["ib"]
            (ib / "ports" / "1").mkdir(parents=True)
            (ib / "ports" / "1" / "state").write_text(d["state"] + "\n")
            (ib / "ports" / "1" / "rate").write_text(d["rate"] + "\n")
            os.symlink(os.path.relpath(dev, ib), ib / "device")
            (dev / "net" / d["net"]).mkdir(parents=True)
    return root


@pytest.fixture
def layout():
    return json.loads(FIXTURE.read_text())["devices"]


def test_each_gpu_gets_its_same_switch_nic(tmp_path, layout):
    topo = nt.discover(build_sysfs(tmp_path, layout), use_pyverbs=False)
    assert len(topo.gpus) == 4  # the BMC's VGA (vendor 0x1a03) is not a GPU
    assert len(topo.nics) == 5
    assert topo.rail_map() == {0: "mlx5_0", 1: "mlx5_1", 2: "mlx5_2", 3: "mlx5_3"}
    nic = topo.nic_for_gpu(2)
    assert nic.rate_gbps == 400 and nic.pci.numa_node == 1 and nic.netdev == "ibp132s0"
    assert {n.name for n in topo.gpu_nics()} == {"mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"}


def test_down_rail_falls_back_to_nearest_gpu_nic_not_the_frontend(tmp_path, layout):
    for d in layout:
        if d.get("ib") == "mlx5_0":
            d["state"] = "1: DOWN"
    topo = nt.discover(build_sysfs(tmp_path, layout), use_pyverbs=False)
    # same socket, same root complex: mlx5_1 beats the front-end mlx5_4 and socket 1's NICs
    assert topo.nic_for_gpu(0).name == "mlx5_1"


def test_frontend_nic_only_when_no_gpu_nic_is_up(tmp_path, layout):
    for d in layout:
        if d.get("ib", "").startswith("mlx5_") and d["ib"] != "mlx5_4":
            d["state"] = "1: DOWN"
    topo = nt.discover(build_sysfs(tmp_path, layout), use_pyverbs=False)
    assert topo.nic_for_gpu(3).name == "mlx5_4"


def test_pcie_distance_orders_switch_root_and_socket(tmp_path, layout):
    topo = nt.discover(build_sysfs(tmp_path, layout), use_pyverbs=False)
    g0 = topo.gpus[0].pci
    by_name = {n.name: n.pci for n in topo.nics}
    switch = g0.distance(by_name["mlx5_0"])  # GPU port -> switch -> NIC port: 2 hops each
    assert switch == 4
    assert switch < g0.distance(by_name["mlx5_1"]) < g0.distance(by_name["mlx5_2"])


def test_no_rdma_device_falls_back_to_tcp_with_one_log_line(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(nt, "_warned", False)
    (tmp_path / "class").mkdir()
    with caplog.at_level(logging.INFO, logger="gcache.sdk.topology"):
        assert nt.choose_rdma_nic(0, sysfs=str(tmp_path)) is None
        assert nt.choose_rdma_nic(1, sysfs=str(tmp_path)) is None
    lines = [r for r in caplog.records if "TCP" in r.getMessage()]
    assert len(lines) == 1


def test_this_machine_has_no_rdma_and_discovery_does_not_fail():
    topo = nt.discover("/sys")  # pyverbs may be absent: sysfs alone decides
    assert all(isinstance(n, nt.Nic) for n in topo.nics)
    if not topo.nics:
        assert nt.choose_rdma_nic(0) is None


def test_nixl_agent_is_pinned_to_the_gpus_rail(tmp_path, layout, monkeypatch):
    from gcache.sdk.transports.nixl import pin_rail

    root = str(build_sysfs(tmp_path, layout))
    assert nt.ucx_net_devices(2, sysfs=root) == "mlx5_2:1"
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert pin_rail(root) == "mlx5_0:1"  # no GPU in this process: the first GPU-side NIC
    assert os.environ["UCX_NET_DEVICES"] == "mlx5_0:1"
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    assert pin_rail(root) == "lo"  # an operator's choice wins
    empty = tmp_path / "none"
    empty.mkdir()
    monkeypatch.delenv("UCX_NET_DEVICES")
    assert pin_rail(str(empty)) == "" and "UCX_NET_DEVICES" not in os.environ

"""The master's ``/metrics`` (Prometheus text, no credential: counts only, no member id
or address): what an operator alerts on for the control plane.

* ``gcache_master_members{state}``: members per state (joining, up, draining, down);
* ``gcache_master_epoch``: the membership epoch this master applied;
* ``gcache_master_raft_role{role}``: 1 for this master's Raft role (leader, follower,
  candidate); ``gcache_master_raft_leader_known`` and ``gcache_master_raft_quorum``
  (1 while it reaches a quorum of masters);
* ``gcache_master_raft_term``: the Raft term, which every election raises by one, so
  ``delta(gcache_master_raft_term[1h])`` counts the elections;
* ``gcache_master_raft_commit_index`` and ``gcache_master_raft_applied_index``;
* ``gcache_master_raft_peers_connected``: the other masters it is connected to;
* plus ``process_*``, ``python_info`` and ``gcache_build_info`` (``gcache.process_metrics``).

Collected at scrape time on the request's thread, from ``RaftNode`` reads that take no
lock of the Raft loop (pysyncobj's ``getStatus`` reads plain attributes).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from gcache.master.raft_node import RaftNode
from gcache.process_metrics import add_process_metrics
from gcache.view import MemberState

_ROLES = {0: "follower", 1: "candidate", 2: "leader"}  # pysyncobj's _RAFT_STATE


class _MasterCollector:
    def __init__(self, node: RaftNode) -> None:
        self.node = node

    def collect(self):
        node = self.node
        counts = dict.fromkeys(MemberState, 0)
        for rec in node.membership.members().values():
            counts[rec.state] += 1
        g = GaugeMetricFamily("gcache_master_members", "Members per state", labels=["state"])
        for state, n in counts.items():
            g.add_metric([state.value], n)
        yield g
        yield GaugeMetricFamily("gcache_master_epoch", "Membership epoch applied here",
                                value=node.membership.epoch)
        st = node.getStatus()
        role = _ROLES.get(int(st.get("state", 0)), "follower")
        r = GaugeMetricFamily("gcache_master_raft_role", "1 for this master's Raft role",
                              labels=["role"])
        for name in _ROLES.values():
            r.add_metric([name], 1.0 if name == role else 0.0)
        yield r
        for name, text, value in (
                ("raft_leader_known", "1 while this master knows a Raft leader",
                 st.get("leader") is not None),
                ("raft_quorum", "1 while this master reaches a quorum of masters",
                 bool(st.get("has_quorum"))),
                ("raft_term", "Raft term (every election raises it by one)",
                 st.get("raft_term", 0)),
                ("raft_commit_index", "Raft commit index", st.get("commit_idx", 0)),
                ("raft_applied_index", "Raft index applied to the membership",
                 st.get("last_applied", 0)),
                ("raft_peers_connected", "Other masters this master is connected to",
                 sum(1 for k, v in st.items()
                     if k.startswith("partner_node_status_server_") and v == 2))):
            yield GaugeMetricFamily(f"gcache_master_{name}", text, value=float(value))


class MasterMetrics:
    """The master's registry; ``render()`` is the /metrics body (any thread)."""

    def __init__(self, node: RaftNode) -> None:
        self.registry = CollectorRegistry()
        add_process_metrics(self.registry, "master")
        self.registry.register(_MasterCollector(node))

    def render(self) -> bytes:
        return generate_latest(self.registry)

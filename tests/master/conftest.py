"""Fixtures of the master tests."""

from __future__ import annotations

import pytest

from gcache.master.raft_node import RaftNode
from gcache.testing.cluster import free_port_pair
from gcache.testing.waiting import wait_for


@pytest.fixture
def leader(tmp_path):
    """A real single-master Raft group (a ``RaftNode`` with no peers), once it leads."""
    node = RaftNode(f"127.0.0.1:{free_port_pair()}", [], str(tmp_path / "raft"), "test-secret")
    try:
        wait_for(lambda: node.is_leader, 20.0)
        yield node
    finally:
        node.close()

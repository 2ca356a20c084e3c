from __future__ import annotations

import pytest

from gcache.testing.cluster import Cluster


@pytest.fixture
def make_cluster(tmp_path):
    """Factory for real-process clusters; every cluster is closed and checked for zombies."""
    made: list[Cluster] = []

    def make(n: int = 1, memory: str = "64MiB", **kw) -> Cluster:
        kw.setdefault("log_dir", str(tmp_path))
        c = Cluster(n, memory, **kw).start()
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def cluster(make_cluster):
    return make_cluster(1)

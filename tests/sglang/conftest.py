"""tests/sglang: the gcache HiCache plugin inside the real SGLang 0.5.23 (CPU-only).

SGLang is installed by ``make test`` (``pip install --no-deps sglang==0.5.23``
plus the ``sglang`` extra). Without it these tests skip and say how to install.
"""

from __future__ import annotations

import os
import warnings

import pytest

import cpu_sglang

from gcache.testing.cluster import Cluster

HAVE_SGLANG = cpu_sglang.install()
HERE = os.path.dirname(os.path.abspath(__file__))

if HAVE_SGLANG:
    with warnings.catch_warnings():  # SGLang's import-time "no CUDA/Triton here" notes
        warnings.simplefilter("ignore")
        import sglang_harness  # noqa: F401


def pytest_collection_modifyitems(config, items):
    if HAVE_SGLANG:
        return
    skip = pytest.mark.skip(reason=cpu_sglang.SKIP_REASON)
    for item in items:
        if str(item.fspath).startswith(HERE) and item.get_closest_marker("integration"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def l3(tmp_path_factory):
    """Three real gcache servers for one test module."""
    c = Cluster(3, "64MiB", log_dir=str(tmp_path_factory.mktemp("gcache-logs"))).start()
    yield c
    c.close()

"""tests/vllm: the gcache KV connector inside the real vLLM 0.33.0 scheduler (CPU-only).

vLLM is installed by ``make test`` (``pip install --no-deps vllm==0.33.0`` plus the
``vllm`` extra). Without it these tests skip and say how to install.
"""

from __future__ import annotations

import os

import pytest

from gcache.testing import cpu_vllm

HAVE_VLLM = cpu_vllm.install()
HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason=cpu_vllm.SKIP_REASON)
    for item in items:
        if str(item.fspath).startswith(HERE) and item.get_closest_marker("integration"):
            item.add_marker(skip)

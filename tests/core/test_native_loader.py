"""``gcache.native`` picks the C module or the twins: GCACHE_NATIVE=0 forces the twins,
and a module that fails to import falls back to them with one log line, never a crash."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

PROBE = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr); "
         "{pre}import gcache.native as n; print(n.ACTIVE, n.copy_spans is n.twins.copy_spans, "
         "n.placement_hashes is n.twins.placement_hashes)")


def probe(env_value: str | None, pre: str = "") -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GCACHE_NATIVE"}
    if env_value is not None:
        env["GCACHE_NATIVE"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE.format(pre=pre)], env=env,
                         capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.strip(), out.stderr


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_switch_off_runs_the_twins(value):
    out, err = probe(value)
    assert out == "python True True"
    assert "GCACHE_NATIVE=0" in err


def test_broken_build_falls_back_with_one_line():
    # a module that raises on import, as a build for another Python or a missing symbol
    out, err = probe(None, pre="sys.modules['gcache._native'] = None; ")
    assert out == "python True True"
    lines = [ln for ln in err.splitlines() if "gcache._native is not available" in ln]
    assert len(lines) == 1 and "pure-Python twins" in lines[0]


def test_stale_build_missing_a_function_falls_back_with_one_line():
    # an extension built from an older tree: it imports, but lacks a newer function
    pre = ("import types; sys.modules['gcache._native'] = types.SimpleNamespace("
           "copy_spans=print, placement_hashes=print); ")
    out, err = probe(None, pre=pre)
    assert out == "python True True"
    lines = [ln for ln in err.splitlines() if "gcache._native is not available" in ln]
    assert len(lines) == 1 and "stale build without byte_views, pread_spans" in lines[0]


def test_built_module_is_used_by_default():
    pytest.importorskip("gcache._native", reason="the C extension is not built here")
    out, _ = probe(None)
    assert out == "native False False"

"""The core package is the bottom layer: it never imports server, SDK, master, bench or CLI
code, with no exemption (the `gcache` command lives in cli/ -> gcache.cli)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

CORE = pathlib.Path(__file__).resolve().parents[2] / "gcache"
FORBIDDEN = ("gcache.server", "gcache.sdk", "gcache.master", "gcache.bench", "gcache.cli")


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: str(p.relative_to(CORE)))
def test_core_module_imports_no_upper_layer(path):
    bad = [m for m in _imports(path) if m.startswith(FORBIDDEN)]
    assert bad == [], f"{path.name} imports {bad}"


def test_importing_core_loads_no_upper_layer():
    code = ("import sys, gcache.protocol, gcache.ring, gcache.config, gcache.hashing, "
            "gcache.status, gcache.view, gcache.testing.cluster, gcache.testing.oracle; "
            "print([m for m in sys.modules if m.startswith(%r)])" % (FORBIDDEN,))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

"""ruff (pyflakes, pycodestyle, bugbear) over the whole tree, so `make test` keeps it clean."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent)) or "ruff"
    r = subprocess.run([ruff, "check", "--no-cache", str(ROOT)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr

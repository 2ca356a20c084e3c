"""``python -m build`` makes a wheel and an sdist of this tree that each install into a
fresh venv and run ``gcache up --workload sessions`` there: the package data (py.typed,
the SGLang plugin, the master's cluster page), the C extension (built from the sdist by its own setup.py) and the
console scripts all make it into an install, not only into the dev tree.

The fresh venvs get the runtime dependencies from this venv's site-packages through a
``.pth`` line (no network, and the dependency versions are the pinned ones), and gcache
itself only from the built artifact (``--no-deps``): an import that resolved to the
source tree would be a false pass, so the test checks where ``gcache`` was imported from.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]


def _fresh_venv(where: Path) -> Path:
    venv.EnvBuilder(with_pip=False).create(where)
    site = next(where.glob("lib/python3*/site-packages"))
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return where / "bin" / "python"


def _pip(python: Path, *args: str) -> None:
    # this venv's pip, installing into the fresh one (it has no pip of its own)
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                        "-q", "--no-deps", "--no-build-isolation", *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.timeout(600)
def test_wheel_and_sdist_install_and_run_the_sessions_workload(tmp_path: Path) -> None:
    out = tmp_path / "dist"
    # no --sdist/--wheel: build makes the sdist, then the wheel from the unpacked sdist
    # (so the sdist must hold all a build needs, and the tree gets no build/ directory)
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir",
                        str(out), str(ROOT)],
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wheel = next(out.glob("gcache-*.whl"))
    sdist = next(out.glob("gcache-*.tar.gz"))
    for artifact in (wheel, sdist):
        python = _fresh_venv(tmp_path / f"venv-{artifact.suffix.strip('.')}")
        _pip(python, str(artifact))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GCACHE_", "PYTHON"))}
        probe = subprocess.run(
            [str(python), "-c", "import gcache, gcache.native as n, gcache.sdk.sglang, "
             "importlib.resources as r; print(gcache.__file__); print(n.ACTIVE); "
             "print(r.files('gcache').joinpath('py.typed').is_file()); "
             "from gcache.master.cluster_page import ClusterPage; "
             "print(all(ClusterPage().get(p).body for p in ('/ui', '/ui/app.js', "
             "'/ui/style.css')))"],
            capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
        assert probe.returncode == 0, probe.stderr
        where, native, typed, page = probe.stdout.split()
        assert str(ROOT) not in where and "site-packages" in where, where
        assert native == "native", f"{artifact.name}: the C extension is not in the install"
        assert typed == "True"
        assert page == "True", f"{artifact.name}: the cluster page's files are not in it"
        up = subprocess.run(
            [str(python.parent / "gcache"), "up", "--servers", "1", "--masters", "0",
             "--memory", "64MiB", "--slab-bytes", "1MiB", "--workload", "sessions",
             "--sessions", "4", "--turns", "2", "--page-bytes", "64KiB"],
            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        assert up.returncode == 0, up.stderr[-3000:]
        assert "token hit rate" in up.stdout and "wrong values" in up.stdout

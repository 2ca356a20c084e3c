"""Every command answers ``--version`` (and ``-V``) with the installed version, and
``gcache.__version__`` is that version."""

from __future__ import annotations

from importlib.metadata import version

import pytest
from click.testing import CliRunner

import gcache
from gcache.bench.cli import main as bench_main
from gcache.cli import main as gcache_main
from gcache.master.cli import main as master_main
from gcache.server.cli import main as server_main

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_package_version_is_the_installed_distribution() -> None:
    assert gcache.__version__ == version("gcache")
    assert gcache.__version__[0].isdigit()


@pytest.mark.parametrize(("command", "prog"), [
    (gcache_main, "gcache"), (server_main, "gcache-server"),
    (master_main, "gcache-master"), (bench_main, "gcache-bench"),
])
@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_every_command_prints_its_version(command, prog: str, flag: str) -> None:
    result = CliRunner().invoke(command, [flag])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"{prog}, version {gcache.__version__}"

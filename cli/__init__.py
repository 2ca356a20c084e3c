"""``gcache``: the operator command (``up``, ``status``, ``admin``).

The application layer, outside the core (``cli/`` -> ``gcache.cli``): it may import the
SDK, the bench and the master client; the core never imports it, and the core's layering
test (tests/core/test_core_imports.py) has no exemption for it.

- ``up.py``: ``gcache up``, a local cluster on loopback, optionally driving a workload;
- ``status.py``: ``gcache status`` and ``gcache admin drain|add|remove``, against the masters.
"""

from __future__ import annotations

import click

from gcache import __version__
from gcache.cli.status import admin, status, tier_cells
from gcache.cli.up import up

__all__ = ["main", "tier_cells"]

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, "-V", "--version", prog_name="gcache")
def main() -> None:
    """gcache: distributed, tiered KV-cache store for LLM inference."""


for _command in (up, status, admin):
    main.add_command(_command)

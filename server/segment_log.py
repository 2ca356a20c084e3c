"""The former name of ``gcache.server.disk`` (the NVMe tier), kept for ``server/cli.py``.

New code imports ``gcache.server.disk`` (``SegmentLog``) or its modules
(``records``: the on-disk format; ``recovery``: restart).
"""

from __future__ import annotations

from gcache.server.disk import DiskError, Entry, SegmentLog, record_geometry, tier_root

__all__ = ["SegmentLog", "Entry", "DiskError", "record_geometry", "tier_root"]

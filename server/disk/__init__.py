"""The NVMe tier: a log-structured segment store of checksummed records.

* ``records``  — the on-disk format (segment header, record, deaths): pure functions.
* ``log``      — ``SegmentLog``: index, segments, reads, appends, compaction; the disk
  side of the movement contract (``gcache.server.movement.DiskSide``).
* ``recovery`` — restart: the index file of a clean stop, the scan after a crash.
"""

from __future__ import annotations

from gcache.errors import DiskError
from gcache.server.disk.log import SegmentLog
from gcache.server.disk.records import Entry, record_geometry, segment_paths, tier_root

__all__ = ["SegmentLog", "Entry", "DiskError", "record_geometry", "segment_paths", "tier_root"]

"""The staging file of a co-located writer: its layout and its name rule.

A client on the server's host never writes the arena (it maps it read-only). It
writes put values into a staging file of its own and asks the server (``PUT_STAGED``)
to copy them into freshly reserved arena chunks, verify the writer's checksum and
publish. The SDK (``gcache.sdk.transports.shm``) creates the file; the server
(``gcache.server.shm_ops``) opens it read-only and validates it. Both follow this
module, so the rule lives in one place:

    {shm_dir}/{arena stem}.stage-{32 lowercase hex}      e.g. gcache-s1.stage-9f0c...

    [header: 4 KiB][data: the frame's values, back to back, in item order]
    header = b"GCSTAGE1" | 16-byte random key | zeros

The key is the capability: the server copies from a staging file only when the frame
names the key the file holds, so a client must be able to *read* a staging file to
make the server read it (it learns nothing through the server it could not read
itself). The file is created ``O_EXCL``, mode 0600 (0640 with the arena's group when
the client runs under another uid than the server, so the server can read it).
"""

from __future__ import annotations

import os
import re

HEADER_BYTES = 4096  # values start page-aligned
MAGIC = b"GCSTAGE1"
KEY_BYTES = 16
_SUFFIX = re.compile(r"\.stage-[0-9a-f]{32}")


def name_prefix(arena_path: str) -> str:
    """``gcache-NAME.stage-`` for the arena ``.../gcache-NAME.arena``."""
    base = os.path.basename(arena_path)
    stem = base[:-len(".arena")] if base.endswith(".arena") else base
    return stem + ".stage-"


def new_name(arena_path: str) -> str:
    return name_prefix(arena_path) + os.urandom(16).hex()


def is_name_for(name: str, arena_path: str) -> bool:
    """Whether ``name`` (a bare file name, no directory) is a staging file name of this
    arena: anything else (a path, another server's prefix, a different shape) is not."""
    stem = name_prefix(arena_path)[:-len(".stage-")]
    return (isinstance(name, str) and name.startswith(stem)
            and _SUFFIX.fullmatch(name[len(stem):]) is not None)


def header(key: bytes) -> bytes:
    return MAGIC + key

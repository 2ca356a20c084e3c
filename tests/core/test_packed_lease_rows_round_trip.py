"""Packed LEASE replies (``"pk": 1``) decode to exactly the rows the server packed.

``pack_lease_rows`` (server) and ``unpack_lease_rows`` (SDK) are the one definition of
the packed form: six little-endian u64 per item. Any rows round-trip to the same flat
values in order; a blob of another length, or anything but bytes, is a ProtocolError
(the SDK then closes the connection, which drops the leases).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gcache.errors import ProtocolError
from gcache.protocol import LEASE_ROW, pack_lease_rows, unpack_lease_rows

pytestmark = [pytest.mark.unit]

_u64 = st.integers(0, (1 << 64) - 1)


@given(rows=st.lists(st.lists(_u64, min_size=LEASE_ROW, max_size=LEASE_ROW), max_size=40))
@pytest.mark.timeout(60)
def test_packed_lease_rows_round_trip(rows):
    blob = pack_lease_rows(rows)
    assert len(blob) == 48 * len(rows)
    assert list(unpack_lease_rows(blob, len(rows))) == [v for r in rows for v in r]
    for bad, n in ((blob + b"\0", len(rows)), (blob, len(rows) + 1), (bytearray(blob),
                                                                       len(rows))):
        with pytest.raises(ProtocolError):
            unpack_lease_rows(bad, n)

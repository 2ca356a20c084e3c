"""``parse_put_items`` and ``self_contained`` take inline fast paths for the usual items
(bytes keys, six ints, whole values): for any items they answer exactly what the general
rules (written out here as the oracle) answer: the same parsed items and checksums, the
same ProtocolError, the same set of self-contained puts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache.errors import ProtocolError
from gcache.protocol import Limits, parse_put_items, self_contained

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

LIM = Limits(max_key_bytes=4)
U64 = 1 << 64


def oracle_parse(items: list, require_checksum: bool) -> list[tuple] | None:
    """The rules: None where a ProtocolError is due."""
    out = []
    for it in items:
        if not (isinstance(it, list) and len(it) in (5, 6)
                and all(isinstance(x, int) for x in it[1:])):
            return None
        if len(it) == 5 and require_checksum:
            return None
        key = it[0]
        if not isinstance(key, (bytes, bytearray)) or not key or len(key) > 4:
            return None
        tl, off, ln, pid = it[1:5]
        if tl < 0 or off < 0 or ln < 0 or off + ln > tl or pid < 0:
            return None
        csum = it[5] if len(it) == 6 else None
        if csum is not None and not 0 <= csum < U64:
            return None
        out.append((bytes(key), tl, off, ln, pid, csum))
    return out


def oracle_whole(parsed: list[tuple]) -> set:
    spans: dict = {}
    for key, tl, off, ln, pid in (p[:5] for p in parsed):
        spans.setdefault((key, pid), []).append((off, off + ln, tl))
    out = set()
    for k, sp in spans.items():
        sp.sort()
        pos, tl = 0, sp[0][2]
        for a, b, t in sp:
            if t != tl or a != pos or b <= a:
                break
            pos = b
        else:
            if pos == tl:
                out.add(k)
    return out


ints = st.one_of(st.integers(0, 6), st.integers(-2, 2), st.booleans(),
                 st.just(U64 - 1), st.just(U64), st.just(1.0))
keys = st.one_of(st.sampled_from([b"a", b"b", b"abcd", b"", b"abcde"]),
                 st.just(bytearray(b"a")), st.just("a"), st.just(5))


@st.composite
def put_items(draw):
    out = []
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.booleans()):  # a usual, valid-looking item
            tl = draw(st.integers(0, 6))
            off = draw(st.integers(0, tl))
            ln = tl - off if draw(st.booleans()) else draw(st.integers(0, tl - off))
            item = [draw(st.sampled_from([b"a", b"b"])), tl, off, ln,
                    draw(st.integers(0, 1)), draw(st.integers(0, 9))]
        else:
            item = [draw(keys)] + [draw(ints) for _ in range(draw(st.sampled_from([4, 5])))]
        out.append(item if draw(st.integers(0, 9)) else tuple(item))
    return out


@settings(max_examples=500, deadline=None)
@given(put_items(), st.booleans())
def test_parse_and_self_contained_follow_the_rules(items, require_checksum):
    want = oracle_parse(items, require_checksum)
    try:
        got = parse_put_items(items, LIM, require_checksum=require_checksum)
    except ProtocolError:
        assert want is None
        return
    assert want is not None and [tuple(p) for p in got] == want
    assert all(type(p.key) is bytes for p in got)
    assert self_contained(got) == oracle_whole(want)

"""``status_of`` (a table lookup) maps every wire value as ``Status(value)`` does, and
whatever ``Status(value)`` refuses (an unknown code, a string, None, a list a hostile
peer sent) to ERROR, never an exception."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gcache.status import Status, status_of

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _enum_rule(v: object) -> Status:
    try:
        return Status(v)
    except (ValueError, TypeError):
        return Status.ERROR


values = st.one_of(st.integers(-5, 40), st.integers(), st.booleans(), st.none(),
                   st.floats(allow_nan=True), st.text(max_size=3), st.binary(max_size=3),
                   st.lists(st.integers(), max_size=2), st.sampled_from(list(Status)),
                   st.dictionaries(st.integers(), st.integers(), max_size=1))


@given(values)
def test_status_of_matches_the_enum(v):
    got = status_of(v)
    assert type(got) is Status
    assert got is _enum_rule(v)


def test_every_code_round_trips():
    assert [status_of(int(s)) for s in Status] == list(Status)
    assert status_of(10_000) is Status.ERROR

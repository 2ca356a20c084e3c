"""Failpoints: the spec grammar, counts, seeded probabilities, errno mapping, off by default."""

from __future__ import annotations

import errno
import timeit

import pytest

from gcache import failpoints
from gcache.errors import ConfigError
from gcache.failpoints import failpoint, fired, os_error, parse

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


@pytest.fixture(autouse=True)
def _reset():
    failpoints.configure(None)
    yield
    failpoints.configure(None)


def test_spec_grammar() -> None:
    points, seed = parse("disk_write=eio, disk_full ,disk_read_corrupt=0.5,x=eio:0.25:3x,seed=7")
    assert seed == 7
    assert (points["disk_write"].action, points["disk_write"].probability) == ("eio", 1.0)
    assert points["disk_full"].action == "on" and points["disk_full"].remaining is None
    assert points["disk_read_corrupt"].probability == 0.5
    x = points["x"]
    assert (x.action, x.probability, x.remaining) == ("eio", 0.25, 3)
    assert parse("") == ({}, 0) and parse(None) == ({}, 0)


@pytest.mark.parametrize("bad", ["Disk=eio", "a=1.5", "a=0", "a=e-io", "seed=x", "a=eio:-1"])
def test_bad_specs_say_what_to_write(bad: str) -> None:
    with pytest.raises(ConfigError, match="failpoint"):
        parse(bad)


def test_off_by_default_and_cheap_when_off() -> None:
    assert failpoint("disk_write") is None
    os_error("disk_write")  # no raise
    per_call = min(timeit.repeat(lambda: failpoint("disk_write"), number=20_000, repeat=3))
    assert per_call / 20_000 < 5e-6  # one dict test: well under a microsecond in practice


def test_counts_limit_firing_and_os_error_maps_errno() -> None:
    failpoints.configure("disk_write=enospc:2x,other")
    for _ in range(2):
        with pytest.raises(OSError) as exc:
            os_error("disk_write", what="writing")
        assert exc.value.errno == errno.ENOSPC and "failpoint disk_write" in str(exc.value)
    os_error("disk_write")  # spent
    assert fired("disk_write") == 2
    assert failpoint("other") == "on" and failpoint("unknown") is None
    with pytest.raises(OSError) as exc:
        os_error("other")  # "on" maps to the default errno
    assert exc.value.errno == errno.EIO


def test_probabilities_are_reproducible_from_the_seed() -> None:
    def run() -> list[bool]:
        failpoints.configure("p=0.3,seed=42")
        return [failpoint("p") is not None for _ in range(1000)]

    a, b = run(), run()
    assert a == b
    assert 200 < sum(a) < 400

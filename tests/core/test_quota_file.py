"""The quota file (gcache.quotas): strict parsing, first matching glob wins, reload keeps
the old quotas on a bad file, the per-namespace memo stays bounded."""

from __future__ import annotations

import pytest

from gcache.errors import ConfigError
from gcache.quotas import QuotaStore, parse_quotas, _CACHE_MAX

pytestmark = [pytest.mark.unit]


def test_first_matching_glob_wins_and_unmatched_is_unlimited(tmp_path):
    p = tmp_path / "q.toml"
    p.write_text('[[quota]]\nnamespaces = "team-a/big*"\nmemory_bytes = "1GiB"\n'
                 '[[quota]]\nnamespaces = "team-a/*"\nmemory_bytes = "64MiB"\n'
                 'disk_bytes = 1000\n')
    q = QuotaStore(str(p))
    assert q.limits(b"team-a/bigmodel").memory_bytes == 1 << 30
    assert q.limits(b"team-a/bigmodel").disk_bytes is None
    assert q.limits(b"team-a/x") == (64 << 20, 1000, "team-a/*")
    assert q.limits(b"team-b/x") == (None, None, "")


@pytest.mark.parametrize("doc, words", [
    ({"quota": [{"namespaces": "a/*", "memory_bytes": "lots"}]}, "memory_bytes"),
    ({"quota": [{"namespaces": "a/*", "memory_bytes": "1.5B"}]}, "memory_bytes"),
    ({"quota": [{"namespaces": "a/*", "memory": "1MiB"}]}, "did you mean 'memory_bytes'"),
    ({"quota": [{"namespaces": "a/*"}]}, "limits nothing"),
    ({"quota": [{"memory_bytes": "1MiB"}]}, "namespaces"),
    ({"quotas": []}, "did you mean 'quota'"),
])
def test_bad_entries_name_the_entry_and_the_fix(doc, words):
    with pytest.raises(ConfigError, match=words):
        parse_quotas(doc, "q.toml")


def test_reload_keeps_old_quotas_on_a_bad_file(tmp_path):
    p = tmp_path / "q.toml"
    p.write_text('[[quota]]\nnamespaces = "a/*"\nmemory_bytes = "1MiB"\n')
    q = QuotaStore(str(p))
    p.write_text('[[quota]]\nnamespaces = "a/*"\nmemory_bytes = "x"\n')
    assert not q.reload() and q.generation == 0
    assert q.limits(b"a/1").memory_bytes == 1 << 20
    p.write_text('[[quota]]\nnamespaces = "a/*"\nmemory_bytes = "2MiB"\n')
    assert q.reload() and q.generation == 1
    assert q.limits(b"a/1").memory_bytes == 2 << 20


def test_memo_is_bounded(tmp_path):
    q = QuotaStore()
    for i in range(3 * _CACHE_MAX):
        q.limits(b"ns-%d" % i)
    assert len(q.table._memo) <= _CACHE_MAX

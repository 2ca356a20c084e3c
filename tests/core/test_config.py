"""Tests for gcache.config: strict parsers, the option table and layered loading."""

from __future__ import annotations

import copy
import pickle
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from gcache.config import (
    OPTIONS,
    Config,
    click_options,
    format_size,
    load_config,
    parse_bool,
    parse_duration_ms,
    parse_size,
    scope_options,
)
from gcache.errors import ConfigError

pytestmark = pytest.mark.unit

KIB, MIB, GIB, TIB = 2**10, 2**20, 2**30, 2**40


# ---------------------------------------------------------------- parsers

@pytest.mark.parametrize(("text", "expected"), [
    (0, 0), (4096, 4096), ("0", 0), ("4096", 4096), ("512B", 512),
    ("64KiB", 64 * KIB), ("1MiB", MIB), ("16GiB", 16 * GIB), ("1TiB", TIB),
    ("1KB", 1000), ("1MB", 10**6), ("1GB", 10**9), ("2TB", 2 * 10**12),
    ("1 GiB", GIB), ("1.5GiB", 3 * GIB // 2), ("0.5KiB", 512), ("2.0", 2),
    # case-insensitive, and the Kubernetes forms the Helm values use
    ("1gib", GIB), ("1GIB", GIB), ("1kb", 1000), ("12gb", 12 * 10**9), ("4Gi", 4 * GIB),
    ("72Gi", 72 * GIB), ("4G", 4 * 10**9), ("512Mi", 512 * MIB), ("2k", 2000), ("1b", 1),
])
def test_parse_size_accepts(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", [
    -1, "-1", "", " ", "1 GiBs", "1e9", "1 ", " 1", "1  GiB", "1Gis", "1KiBB",
    "1.5", "1.3B", "0.1KiB", ".5GiB", "1.GiB", "GiB", "1XB", "1_000", "1,000",
    "٣", True, 1.0, None,
])
def test_parse_size_rejects(text: object) -> None:
    with pytest.raises(ConfigError):
        parse_size(text)  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "suggestion"), [
    ("4GBi", "did you mean 4GiB?"), ("1 GiBs", "did you mean 1 GiB?"),
    ("64KIBS", "did you mean 64KiB?"),
])
def test_parse_size_names_the_nearest_unit(text: str, suggestion: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(suggestion)):
        parse_size(text)


@pytest.mark.parametrize(("n", "expected"), [
    (0, "0B"), (512, "512B"), (1000, "1000B"), (KIB, "1KiB"), (1536, "1.5KiB"),
    (MIB, "1MiB"), (GIB, "1GiB"), (16 * GIB, "16GiB"), (TIB, "1TiB"),
    (1025 * KIB, "1025KiB"), (MIB + MIB // 4, "1.25MiB"),
])
def test_format_size(n: int, expected: str) -> None:
    assert format_size(n) == expected


@given(st.integers(min_value=0, max_value=2**40).map(lambda k: k * 1024))
def test_format_size_round_trips(n: int) -> None:
    assert parse_size(format_size(n)) == n


@pytest.mark.parametrize(("text", "expected"), [
    (True, True), (False, False), ("true", True), ("TRUE", True), ("1", True),
    ("yes", True), ("On", True), ("false", False), ("0", False), ("no", False),
    ("OFF", False),
])
def test_parse_bool_accepts(text: str | bool, expected: bool) -> None:
    assert parse_bool(text) is expected


@pytest.mark.parametrize("text", ["", "y", "n", "2", "truee", " true", 1, None])
def test_parse_bool_rejects(text: object) -> None:
    with pytest.raises(ConfigError):
        parse_bool(text)  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "expected"), [
    (250, 250), (2000.0, 2000), ("0", 0), ("250", 250), ("500ms", 500), ("2s", 2000),
    ("1.5s", 1500), ("1m", 60_000), ("0.5m", 30_000), ("2 s", 2000),
])
def test_parse_duration_accepts(text: str | int | float, expected: int) -> None:
    assert parse_duration_ms(text) == expected


@pytest.mark.parametrize("text", [
    -1, "-1", "", "1h", "2S", "1.5", "0.5ms", "1e3", "2 s ", float("inf"), float("nan"), True,
])
def test_parse_duration_rejects(text: object) -> None:
    with pytest.raises(ConfigError):
        parse_duration_ms(text)  # type: ignore[arg-type]


# ---------------------------------------------------------------- table

def test_table_defaults_are_valid_and_named_by_unit() -> None:
    for scope in ("server", "client", "master"):
        cfg = load_config(scope, env={})
        assert set(cfg.sources.values()) <= {"default"}
    for opt in OPTIONS.values():
        assert opt.env == "GCACHE_" + opt.name.upper()
        if opt.type == "size":
            assert opt.name.endswith("_bytes")
        if opt.type == "duration_ms":
            assert opt.name.endswith("_ms")
    assert OPTIONS["memory_bytes"].default == GIB
    assert load_config("client", env={}).slice_bytes == MIB


def test_scopes_select_options() -> None:
    server = {o.name for o in scope_options("server")}
    client = {o.name for o in scope_options("client")}
    assert "memory_bytes" in server and "memory_bytes" not in client
    assert "timeout_ms" in client and "timeout_ms" not in server
    with pytest.raises(ConfigError, match="scope"):
        scope_options("nope")


# ---------------------------------------------------------------- loading

def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gcache.toml"
    path.write_text(text)
    return path


def test_precedence_file_env_cli(tmp_path: Path) -> None:
    path = _write(tmp_path, 'memory_bytes = "2GiB"\nprefault = false\n'
                            '[server]\nmax_key_bytes = 100\nname = "from-file"\n')
    env = {"GCACHE_MAX_KEY_BYTES": "200", "GCACHE_NAME": "from-env",
           "GCACHE_TIMEOUT_MS": "9s"}  # client option: ignored by a server
    cfg = load_config("server", file=path, env=env, cli={"name": "from-cli", "listen": None})
    assert (cfg.memory_bytes, cfg.prefault, cfg.max_key_bytes, cfg.name) == \
        (2 * GIB, False, 200, "from-cli")
    assert cfg.listen == "127.0.0.1:7070"
    src = cfg.sources
    assert src["memory_bytes"] == src["prefault"] == f"file:{path}"
    assert src["max_key_bytes"] == "env:GCACHE_MAX_KEY_BYTES"
    assert src["name"] == "cli"
    assert src["listen"] == "default"
    assert cfg.as_dict()["memory_bytes"] == 2 * GIB
    assert not hasattr(cfg, "timeout_ms")


def test_shared_file_serves_both_scopes(tmp_path: Path) -> None:
    path = _write(tmp_path, '[server]\nmemory_bytes = "4GiB"\n[client]\ntimeout_ms = "3s"\n')
    assert load_config("server", file=path, env={}).memory_bytes == 4 * GIB
    assert load_config("client", file=path, env={}).timeout_ms == 3000


def test_config_is_frozen() -> None:
    cfg = load_config("server", env={})
    with pytest.raises(AttributeError):
        cfg.memory_bytes = 1
    cfg.sources["memory_bytes"] = "cli"
    assert cfg.sources["memory_bytes"] == "default"
    assert isinstance(cfg, Config)
    clone = pickle.loads(pickle.dumps(copy.copy(cfg)))
    assert clone.as_dict() == cfg.as_dict() and clone.sources == cfg.sources


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GCACHE_QUEUE_DEPTH", "7")
    cfg = load_config("client")
    assert cfg.queue_depth == 7 and cfg.sources["queue_depth"] == "env:GCACHE_QUEUE_DEPTH"


def test_file_keys_take_the_flag_spellings(tmp_path: Path) -> None:
    path = _write(tmp_path, '[server]\nmemory = "4Gi"\ndisk = "2G"\ndrain-on-stop = 60\n'
                            'high-watermark = 0.95\n')
    cfg = load_config("server", path, env={})
    assert cfg.memory_bytes == 4 * GIB and cfg.disk_bytes == 2 * 10**9
    assert cfg.drain_on_stop_ms == 60_000 and cfg.high_watermark == 0.95
    assert cfg.sources["memory_bytes"] == f"file:{path}"


def test_file_key_set_under_two_spellings_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, 'memory = "4GiB"\nmemory_bytes = "8GiB"\n')
    with pytest.raises(ConfigError, match="memory_bytes.*set twice"):
        load_config("server", path, env={})


def test_unknown_file_key_suggests(tmp_path: Path) -> None:
    path = _write(tmp_path, '[server]\nmemory_byte = "1GiB"\n')
    with pytest.raises(ConfigError) as info:
        load_config("server", file=path, env={})
    msg = str(info.value)
    assert "'memory_byte'" in msg and str(path) in msg and "did you mean 'memory_bytes'" in msg


def test_misplaced_and_bogus_file_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="client-scope"):
        load_config("server", file=_write(tmp_path, '[server]\ntimeout_ms = 5\n'), env={})
    with pytest.raises(ConfigError, match="no such option"):
        load_config("server", file=_write(tmp_path, 'zzz = 1\n'), env={})
    with pytest.raises(ConfigError, match="twice"):
        load_config("server", file=_write(tmp_path, 'name = "a"\n[server]\nname = "b"\n'),
                    env={})


def test_bad_file_reports_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config("server", file=_write(tmp_path, "memory_bytes = \n"), env={})
    missing = tmp_path / "missing.toml"
    with pytest.raises(ConfigError, match="missing.toml"):
        load_config("server", file=missing, env={})


def test_bad_values_name_option_source_and_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("server", env={"GCACHE_MEMORY_BYTES": "16 GiBs"})
    msg = str(info.value)
    assert "memory_bytes" in msg and "GCACHE_MEMORY_BYTES" in msg and "'16 GiBs'" in msg
    assert "16GiB" in msg  # the hint shows a valid form
    with pytest.raises(ConfigError, match="--max-batch-items"):
        load_config("server", env={}, cli={"max_batch_items": "0"})
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path))):
        load_config("server", file=_write(tmp_path, "prefault = 3\n"), env={})
    with pytest.raises(ConfigError, match="unknown option 'bogus'"):
        load_config("server", env={}, cli={"bogus": "1"})


@pytest.mark.parametrize(("high", "low", "ok"), [
    ("0.95", "0.90", True), ("1", "0.5", True), ("0.9", "0.9", False),
    ("0.8", "0.9", False), ("1.5", "0.9", False), ("0.9", "0", False), ("0.9", "-0.1", False),
])
def test_watermarks(high: str, low: str, ok: bool) -> None:
    env = {"GCACHE_HIGH_WATERMARK": high, "GCACHE_LOW_WATERMARK": low}
    if ok:
        cfg = load_config("server", env=env)
        assert (cfg.high_watermark, cfg.low_watermark) == (float(high), float(low))
    else:
        with pytest.raises(ConfigError, match="watermark"):
            load_config("server", env=env)


@pytest.mark.parametrize(("name", "value", "ok"), [
    ("listen", "0.0.0.0:0", True), ("listen", "[::1]:7070", True), ("listen", "h:65535", True),
    ("listen", "", False), ("listen", "host", False), ("listen", ":7070", False),
    ("listen", "h:65536", False), ("listen", "::1:7070", False),
    ("metrics_listen", "", True), ("metrics_listen", "127.0.0.1:9100", True),
    ("log_level", "debug", True), ("log_level", "LOUD", False),
    ("log_format", "text", True), ("log_format", "xml", False),
    ("max_connections", "1", True), ("max_connections", "0", False),
    ("pending_put_timeout_ms", "30s", True),
    ("promote_policy", "second-hit", True), ("promote_policy", "never", True),
    ("promote_policy", "sometimes", False), ("segment_bytes", "64MiB", True),
    ("segment_bytes", "512KiB", False), ("segment_bytes", "1000000", False),
    ("disk_bytes", "512GiB", True), ("disk_direct_io", "off", True),
    ("disk_direct_io", "maybe", False), ("failpoints", "disk_write=eio:3x", True),
    ("failpoints", "disk_write=2.5", False), ("failpoints", "Disk", False),
    ("migrate_mbps", "0", True), ("migrate_mbps", "250.5", True),
    ("migrate_mbps", "-1", False), ("migrate_mbps", "fast", False),
])
def test_option_validation(name: str, value: str, ok: bool) -> None:
    if ok:
        load_config("server", env={}, cli={name: value})
    else:
        with pytest.raises(ConfigError, match=name.replace("_", "[-_]")):
            load_config("server", env={}, cli={name: value})


def test_describe_masks_token() -> None:
    cfg = load_config("server", env={"GCACHE_TOKEN": "s3cret"}, cli={"memory_bytes": "2GiB"})
    line = cfg.describe()
    assert "s3cret" not in line and "s3cret" not in repr(cfg)
    assert "token=*** (env:GCACHE_TOKEN)" in line
    assert "memory_bytes=2GiB (cli)" in line
    assert "listen" not in line and "\n" not in line
    assert load_config("client", env={}).describe().endswith("all defaults")


# ---------------------------------------------------------------- click

def test_click_options_round_trip() -> None:
    seen: dict[str, Config] = {}

    @click.command()
    @click_options("server")
    def main(**kwargs: object) -> None:
        seen["cfg"] = load_config("server", env={}, cli=kwargs)

    runner = CliRunner()
    result = runner.invoke(main, ["--memory-bytes", "2GiB", "--prefault", "off",
                                  "--max-key-bytes", "64"])
    assert result.exit_code == 0, result.output
    cfg = seen["cfg"]
    assert (cfg.memory_bytes, cfg.prefault, cfg.max_key_bytes) == (2 * GIB, False, 64)
    assert cfg.sources["memory_bytes"] == "cli" and cfg.sources["listen"] == "default"

    help_text = runner.invoke(main, ["--help"]).output
    assert "--memory-bytes" in help_text and "GCACHE_MEMORY_BYTES" in help_text
    assert "--timeout-ms" not in help_text

    bad = runner.invoke(main, ["--memory-bytes", "lots"])
    assert isinstance(bad.exception, ConfigError) and "--memory-bytes" in str(bad.exception)

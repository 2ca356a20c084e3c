"""The SGLang plugin's ``credential`` extra_config key reaches the gcache client: a
credential granted ``sglang/*`` reads and writes the engine's namespace, one granted
another prefix gets ``AUTH`` (a miss to SGLang), and a malformed one fails the attach."""

from __future__ import annotations

import pytest

from test_backend_contract import _config, _factory

from gcache.status import Status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SECRET, OTHER = "s" * 24, "t" * 24
CREDS = f"""
[[credential]]
id = "engine"
secret = "{SECRET}"
grants = [{{ namespaces = "sglang/*", rights = ["read", "write"] }}]

[[credential]]
id = "elsewhere"
secret = "{OTHER}"
grants = [{{ namespaces = "other/*", rights = ["read", "write"] }}]
"""


@pytest.fixture
def scoped(make_cluster, tmp_path, monkeypatch):
    for var in ("GCACHE_TOKEN", "GCACHE_CREDENTIAL"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "creds.toml"
    path.write_text(CREDS)
    return make_cluster(1, "32MiB", extra=["--credentials-file", str(path)])


def test_plugin_passes_its_credential(scoped):
    be = _factory(_config(scoped.addresses, credential=f"engine:{SECRET}"))
    try:
        assert be.namespace == "sglang/org-tiny-model"
        assert be.client.put("page", b"kv" * 100) == Status.OK
        assert be.client.get("page") == b"kv" * 100
    finally:
        be.close()
    be = _factory(_config(scoped.addresses, credential=f"elsewhere:{OTHER}"))
    try:
        assert be.client.put("page2", b"kv") == Status.AUTH
        assert be.client.get("page") is None
        assert not be.exists("page")
    finally:
        be.close()


def test_malformed_credential_fails_the_attach_without_echoing_it():
    from gcache.errors import ConfigError

    with pytest.raises(ConfigError, match="id:secret") as err:
        _factory(_config(["127.0.0.1:1"], credential="no-colon-secret-value"))
    assert "no-colon-secret-value" not in str(err.value)

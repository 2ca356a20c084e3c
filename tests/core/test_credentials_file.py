"""The credentials file is parsed strictly: every error names the file, the entry and
the fix, and never shows a secret. Grants match namespaces by case-sensitive glob."""

from __future__ import annotations

import pytest

from gcache.config import load_config
from gcache.credentials import (CredentialTable, Right, auth_fields, load_credentials,
                                parse_client_credential)
from gcache.errors import ConfigError

pytestmark = pytest.mark.unit

S, S2, S3 = "x" * 24, "z" * 24, "w" * 24
GOOD = f"""
[[credential]]
id = "team-a"
secret = "{S}"
grants = [{{ namespaces = "team-a/*", rights = ["read", "write"] }},
          {{ namespaces = "shared", rights = ["read"] }}]

[[credential]]
id = "ops"
secret = "{S2}"
grants = [{{ namespaces = "*", rights = ["admin"] }}]

[[credential]]
id = "fleet"
secret = "{S3}"
server = true
"""


def _load(tmp_path, text: str):
    p = tmp_path / "creds.toml"
    p.write_text(text)
    return load_credentials(p), str(p)


def test_good_file_and_rights(tmp_path):
    creds, _ = _load(tmp_path, GOOD)
    a, ops, fleet = creds["team-a"], creds["ops"], creds["fleet"]
    assert a.allows(Right.READ, b"team-a/llama") and a.allows(Right.WRITE, b"team-a/x/y")
    assert a.allows(Right.READ, b"shared") and not a.allows(Right.WRITE, b"shared")
    assert not a.allows(Right.READ, b"team-b/llama") and not a.allows(Right.READ, b"TEAM-A/x")
    assert not a.allows(Right.ADMIN, b"team-a/x") and not a.cluster_admin
    assert ops.allows(Right.WRITE, b"anything") and ops.cluster_admin
    assert fleet.server and not fleet.allows(Right.READ, b"x")
    assert S not in repr(a)


@pytest.mark.parametrize("text,needles", [
    ("", ["no [[credential]]"]),
    ("[[credentials]]\nid='a'", ["unknown key 'credentials'", "did you mean 'credential'"]),
    (f"[[credential]]\nid='a:b'\nsecret='{S}'\nserver=true", ["#1", "no ':'"]),
    ("[[credential]]\nid='a'\nsecret='short'\nserver=true", ["'a'", "openssl rand"]),
    (f"[[credential]]\nid='a'\nsecret='{S}'", ["'a'", "grants nothing"]),
    (f"[[credential]]\nid='a'\nsecret='{S}'\ngrant=[]", ["unknown key 'grant'", "'grants'"]),
    (f"[[credential]]\nid='a'\nsecret='{S}'\ngrants=[{{namespaces='x', rights=['rw']}}]",
     ["grant #1", "read, write, admin"]),
    (f"[[credential]]\nid='a'\nsecret='{S}'\ngrants=[{{namespace='x', rights=['read']}}]",
     ["grant #1", "did you mean 'namespaces'"]),
    (f"[[credential]]\nid='a'\nsecret='{S}'\nserver=true\n"
     f"[[credential]]\nid='a'\nsecret='{S2}'\nserver=true", ["#2", "used twice"]),
    (f"[[credential]]\nid='a'\nsecret='{S}'\nserver=true\n"
     f"[[credential]]\nid='b'\nsecret='{S}'\nserver=true", ["#2", "also the secret of 'a'"]),
    ("not toml [", ["not valid TOML"]),
])
def test_bad_files_name_file_entry_and_fix(tmp_path, text, needles):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    msg = str(err.value)
    assert str(tmp_path) in msg
    for n in needles:
        assert n in msg, msg
    assert S not in msg


def test_missing_file_says_so(tmp_path):
    with pytest.raises(ConfigError, match="cannot read credentials file"):
        load_credentials(tmp_path / "absent.toml")


def test_table_verifies_macs_bearers_and_reloads(tmp_path):
    creds, _ = _load(tmp_path, GOOD)
    t = CredentialTable(creds, token="legacy-token")
    nonce = b"n" * 16
    mac = auth_fields(parse_client_credential(f"team-a:{S}"), nonce)
    assert t.verify_mac(mac["id"], mac["mac"], nonce) is creds["team-a"]
    assert t.verify_mac("ops", mac["mac"], nonce) is None
    assert t.verify_mac("nobody", mac["mac"], nonce) is None
    legacy = t.verify_mac(None, auth_fields("legacy-token", nonce)["mac"], nonce)
    assert legacy is not None and legacy.cluster_admin and legacy.server
    assert t.verify_bearer(f"Bearer ops:{S2}") is creds["ops"]
    assert t.verify_bearer("Bearer legacy-token") is legacy
    assert t.verify_bearer(f"Bearer ops:{S}") is None and t.verify_bearer("ops") is None
    # a newer generation: changed secret or removed id -> None; same secret -> new grants
    creds2, _ = _load(tmp_path, GOOD.replace(S2, "y" * 24))
    t2 = CredentialTable(creds2, token="legacy-token")
    assert t2.current(creds["ops"]) is None
    assert t2.current(creds["team-a"]) is creds2["team-a"]
    assert t2.current(legacy) is t2.token_cred
    assert CredentialTable({}, "").verify_mac("x", b"", nonce).cluster_admin  # auth off


def test_client_credential_option_is_validated_and_masked():
    cfg = load_config("client", env={"GCACHE_CREDENTIAL": f"team-a:{S}"})
    assert parse_client_credential(cfg.credential).id == "team-a"
    assert S not in repr(cfg) and S not in cfg.describe()
    with pytest.raises(ConfigError) as err:
        load_config("client", env={"GCACHE_CREDENTIAL": "no-colon-here"})
    assert "no-colon-here" not in str(err.value) and "id:secret" in str(err.value)

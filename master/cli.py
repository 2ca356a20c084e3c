"""``gcache-master``: one member of the 3-node Raft group that owns membership.

``--listen`` is the HTTP API address; the Raft port is the API port + 1.
``--peers`` lists the other masters' API addresses. Prints
``GCACHE_MASTER=host:port`` once the API serves; stops cleanly on SIGTERM.
``--config FILE`` reads defaults for every other flag from the file's ``[master]``
table (keys spelled as the flags, with ``-`` or ``_``); the precedence is
file < environment < flags, and secrets are refused there. ``--credentials-file`` scopes the API (gcache.credentials); SIGHUP reloads it (a
bad file keeps the old credentials and logs why).

The Raft secret. pysyncobj decrypts every Raft frame with a key derived from
its password and then unpickles it, so whoever knows the password and can
reach the Raft port runs code in the master. The password is therefore the
masters' own secret (``--raft-secret-file`` / ``GCACHE_RAFT_SECRET``), never
the token that servers and clients hold:

* a Raft port off loopback, or any master with peers, requires it;
* a lone master on loopback without one gets a random per-process secret
  (it has nobody to share it with);
* it must differ from the token and be at least 16 characters.
"""

from __future__ import annotations

import difflib
import hmac
import logging
import os
import secrets
import socket
import threading
import tomllib

import click

from gcache import __version__
from gcache.config import parse_bool
from gcache.credentials import CredentialStore
from gcache.errors import ConfigError
from gcache.kv_events import check_kv_events
from gcache.logs import setup_logging
from gcache.network import check_bind, is_loopback, split_hostport
from gcache.signals import relay_signals
from gcache.tls import client_context, server_context

log = logging.getLogger("gcache.master")

RAFT_PORT_OFFSET = 1
RAFT_SECRET_MIN_CHARS = 16
_RAFT_SECRET_HOWTO = ("generate one with `openssl rand -hex 32` and give the same value to the "
                      "masters only, in GCACHE_RAFT_SECRET or a file named by "
                      "--raft-secret-file (never to servers or clients)")


def check_ports_free(listen: str) -> None:
    """Bind-probe the API port and the Raft port (API port + 1) before any state is made:
    a busy one is a one-line error naming it (pysyncobj would retry a busy Raft port
    forever while the master logged "serving"). Raises ValueError."""
    host, port = split_hostport(listen)
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for p, what in ((port, "--listen"),
                    (port + RAFT_PORT_OFFSET, "the Raft port (--listen's port + 1)")):
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, p))
            except OSError as exc:
                raise ValueError(f"cannot bind {what} {host}:{p}: "
                                 f"{exc.strerror or exc}") from None


def raft_address(api: str) -> str:
    host, port = api.rsplit(":", 1)
    return f"{host}:{int(port) + RAFT_PORT_OFFSET}"


def resolve_raft_secret(listen: str, peers: list[str], secret: str, secret_file: str | None,
                        token: str) -> tuple[str, str]:
    """The Raft password and where it came from; ValueError says what to set."""
    if secret and secret_file:
        raise ValueError("give the Raft secret once: --raft-secret (GCACHE_RAFT_SECRET) or "
                         "--raft-secret-file (GCACHE_RAFT_SECRET_FILE), not both")
    source = "GCACHE_RAFT_SECRET"
    if secret_file:
        try:
            with open(secret_file, encoding="utf-8") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the Raft secret file {secret_file}: {exc}") from None
        if not secret:
            raise ValueError(f"the Raft secret file {secret_file} is empty: "
                             f"{_RAFT_SECRET_HOWTO}")
        source = f"file {secret_file}"
    if not secret:
        host = split_hostport(raft_address(listen))[0]
        if not is_loopback(host):
            raise ValueError(f"refusing to bind the Raft port on non-loopback host {host} "
                             f"without a Raft secret: {_RAFT_SECRET_HOWTO}")
        if peers:
            raise ValueError("masters with --peers need a shared Raft secret (a random one "
                             f"per process cannot be shared): {_RAFT_SECRET_HOWTO}")
        return secrets.token_hex(32), "random (a lone loopback master)"
    if len(secret) < RAFT_SECRET_MIN_CHARS:
        raise ValueError(f"the Raft secret is shorter than {RAFT_SECRET_MIN_CHARS} characters: "
                         f"{_RAFT_SECRET_HOWTO}")
    if token and hmac.compare_digest(secret.encode(), token.encode()):
        raise ValueError("the Raft secret equals the token, which every server and client "
                         f"holds: {_RAFT_SECRET_HOWTO}")
    return secret, source


# flags a config file may not set: secrets belong in env vars or their own files
_FILE_REFUSED = {"token": "GCACHE_TOKEN or --credentials-file",
                 "raft_secret": "GCACHE_RAFT_SECRET or --raft-secret-file"}


def _read_config(ctx: click.Context, param: click.Parameter, path: str | None) -> str | None:
    """Eager ``--config``: the file's ``[master]`` table becomes the command's defaults
    (click then resolves flag > env var > these > built-in default)."""
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            table = tomllib.load(fh).get("master", {})
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise click.BadParameter(f"{path} is not valid TOML ({exc})") from None
    if not isinstance(table, dict):
        raise click.BadParameter(f"{path}: [master] must be a table")
    names = sorted(p.name for p in ctx.command.params
                   if p.name and p.name not in ("config", "version"))
    defaults: dict[str, object] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name in _FILE_REFUSED:
            raise click.BadParameter(f"{path}: {key!r} is a secret; set it with "
                                     f"{_FILE_REFUSED[name]}, not in a config file")
        if name not in names:
            near = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise click.BadParameter(f"{path}: unknown [master] key {key!r}{hint}")
        defaults[name] = value
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return path


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "-V", "--version", prog_name="gcache-master")
@click.option("--config", type=click.Path(dir_okay=False), is_eager=True, expose_value=False,
              callback=_read_config,
              help="TOML file whose [master] table sets defaults for the flags below (keys "
                   "as the flags: join-timeout-s or join_timeout_s). Precedence: file < env "
                   "< flags. Secrets (token, raft-secret) are refused there.")
@click.option("--listen", required=True, envvar="GCACHE_MASTER_LISTEN",
              help="HTTP API address HOST:PORT (the Raft port is PORT+1). [env GCACHE_MASTER_LISTEN]")
@click.option("--peers", default="", envvar="GCACHE_MASTER_PEERS",
              help="The other masters' API addresses, comma-separated. [env GCACHE_MASTER_PEERS]")
@click.option("--data-dir", required=True, type=click.Path(file_okay=False),
              envvar="GCACHE_MASTER_DATA_DIR",
              help="RocksDB state + Raft journal; keep it on a persistent volume.")
@click.option("--token", default="", envvar="GCACHE_TOKEN",
              help="Legacy shared token of masters, servers and clients: full-rights API auth "
                   "(prefer --credentials-file). Off loopback one of them is required. "
                   "[env GCACHE_TOKEN]")
@click.option("--raft-secret", default="", envvar="GCACHE_RAFT_SECRET", show_default=False,
              help="The masters' own Raft password (pysyncobj unpickles what it decrypts "
                   "with it): the same random value on every master, never on servers or "
                   "clients. Required off loopback and with --peers. Prefer the env var or "
                   "--raft-secret-file: a flag shows in ps. [env GCACHE_RAFT_SECRET]")
@click.option("--raft-secret-file", default=None, envvar="GCACHE_RAFT_SECRET_FILE",
              type=click.Path(dir_okay=False),
              help="Read the Raft secret from this file (a mounted Secret, a systemd "
                   "credential). [env GCACHE_RAFT_SECRET_FILE]")
@click.option("--credentials-file", default="", envvar="GCACHE_CREDENTIALS_FILE",
              help="TOML file of scoped credentials (see gcache.credentials); servers need "
                   "server = true, /admin and /status need admin on \"*\". Reloaded on "
                   "SIGHUP. [env GCACHE_CREDENTIALS_FILE]")
@click.option("--heartbeat-timeout-ms", default=3000, show_default=True, type=click.IntRange(100),
              envvar="GCACHE_HEARTBEAT_TIMEOUT_MS",
              help="A server silent this long is marked down (epoch moves).")
@click.option("--join-ramp-s", default=8.0, show_default=True, type=click.FloatRange(0),
              envvar="GCACHE_MASTER_JOIN_RAMP_S",
              help="A new server (an id never seen, while another member is up) joins "
                   "JOINING: in the ring from its first view, at 1/4 of its capacity weight, "
                   "raised in steps to full over this many seconds, so a cold server does not "
                   "take every new write at once; it turns UP once every other member has "
                   "handed it its keys. 0: a new server is UP at full weight at once. "
                   "[env GCACHE_MASTER_JOIN_RAMP_S]")
@click.option("--join-timeout-s", default=120.0, show_default=True,
              type=click.FloatRange(0, min_open=True), envvar="GCACHE_MASTER_JOIN_TIMEOUT_S",
              help="A join still waiting for the other members' handoff this long after it "
                   "started is marked UP anyway (logged with the members still handing "
                   "off). [env GCACHE_MASTER_JOIN_TIMEOUT_S]")
@click.option("--request-deadline-ms", default=5000, show_default=True,
              type=click.IntRange(100), envvar="GCACHE_MASTER_REQUEST_DEADLINE_MS",
              help="A request's line, headers and body must all arrive within this (one "
                   "deadline, not per read); the answer, e.g. a /view long-poll, is not under "
                   "it. [env GCACHE_MASTER_REQUEST_DEADLINE_MS]")
@click.option("--max-connections", default=1024, show_default=True, type=click.IntRange(1),
              envvar="GCACHE_MASTER_MAX_CONNECTIONS",
              help="API connections served at once (one thread each; every server and SDK "
                   "client holds one for its /view long-poll). Beyond it: 503 and close. "
                   "[env GCACHE_MASTER_MAX_CONNECTIONS]")
@click.option("--max-connections-per-ip", default=256, show_default=True,
              type=click.IntRange(0), envvar="GCACHE_MASTER_MAX_CONNECTIONS_PER_IP",
              help="API connections served at once from one peer address (0: no cap). The "
                   "servers and SDK clients of a host share its address (one /view long-poll "
                   "each): keep it above their count. [env GCACHE_MASTER_MAX_CONNECTIONS_PER_IP]")
@click.option("--raft-compaction-min-entries", default=5000, show_default=True,
              type=click.IntRange(2), envvar="GCACHE_MASTER_RAFT_COMPACTION_MIN_ENTRIES",
              help="Compact the Raft log into a snapshot once it holds this many entries "
                   "(or every 300 s). [env GCACHE_MASTER_RAFT_COMPACTION_MIN_ENTRIES]")
@click.option("--tls-cert-file", default="", envvar="GCACHE_TLS_CERT_FILE",
              help="PEM certificate chain: the API serves https only, and forwards to the "
                   "leader over https presenting it. [env GCACHE_TLS_CERT_FILE]")
@click.option("--tls-key-file", default="", envvar="GCACHE_TLS_KEY_FILE",
              help="PEM key of --tls-cert-file (empty: in the same PEM). "
                   "[env GCACHE_TLS_KEY_FILE]")
@click.option("--tls-ca-file", default="", envvar="GCACHE_TLS_CA_FILE",
              help="PEM CA bundle: verifies client certificates and the other masters. "
                   "[env GCACHE_TLS_CA_FILE]")
@click.option("--tls-require-client-cert", default="false", envvar="GCACHE_TLS_REQUIRE_CLIENT_CERT",
              help="mTLS on the API: refuse clients without a certificate signed by "
                   "--tls-ca-file (true|false). [env GCACHE_TLS_REQUIRE_CLIENT_CERT]")
@click.option("--kv-events-endpoint", default="", envvar="GCACHE_KV_EVENTS_ENDPOINT",
              help="ZMQ PUB endpoint to bind (tcp://HOST:PORT or ipc:///path) where the "
                   "leader publishes AllBlocksCleared on kv@<server>@* when it marks a server "
                   "down or removes it (docs/kv-events.md); empty: off. "
                   "[env GCACHE_KV_EVENTS_ENDPOINT]")
@click.option("--log-level", default="INFO", show_default=True, envvar="GCACHE_LOG_LEVEL")
@click.option("--log-format", type=click.Choice(["json", "text"]), default="json",
              show_default=True, envvar="GCACHE_LOG_FORMAT")
def main(listen: str, peers: str, data_dir: str, token: str, raft_secret: str,
         raft_secret_file: str | None, credentials_file: str, heartbeat_timeout_ms: int,
         join_ramp_s: float, join_timeout_s: float, request_deadline_ms: int, max_connections: int, max_connections_per_ip: int,
         raft_compaction_min_entries: int,
         tls_cert_file: str, tls_key_file: str,
         tls_ca_file: str, tls_require_client_cert: str, kv_events_endpoint: str,
         log_level: str, log_format: str) -> None:
    """Run a gcache-master (membership, heartbeats, discovery; never on the IO path)."""
    setup_logging(log_level, log_format)
    peer_list = [p.strip() for p in peers.split(",") if p.strip() and p.strip() != listen]
    try:
        credentials = CredentialStore(credentials_file, token)
        check_bind(listen, credentials.required)
        check_kv_events(kv_events_endpoint, "", credentials.required)
        password, secret_source = resolve_raft_secret(listen, peer_list, raft_secret,
                                                      raft_secret_file, token)
        check_ports_free(listen)  # after the config checks: they are what to fix first
    except (ValueError, ConfigError) as exc:
        raise SystemExit(f"gcache-master: {exc}") from None
    try:
        require = parse_bool(tls_require_client_cert)
        tls = peer_tls = None
        if tls_cert_file or tls_key_file or require:
            tls = server_context(tls_cert_file, tls_key_file, tls_ca_file, require)
            peer_tls = client_context(tls_ca_file, tls_cert_file, tls_key_file)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    from gcache.master.api import MasterService
    from gcache.master.raft_node import RaftNode
    from gcache.master.raft_snapshot import SnapshotRefused

    raft_to_api = {raft_address(a): a for a in [listen, *peer_list]}
    try:
        node = RaftNode(raft_address(listen), [raft_address(p) for p in peer_list], data_dir,
                        password, compaction_min_entries=raft_compaction_min_entries)
    except SnapshotRefused as exc:
        log.error("%s", exc)
        raise SystemExit(f"gcache-master: {exc}") from None
    import zmq

    try:
        svc = MasterService(node, listen=listen, token=token, credentials=credentials,
                            heartbeat_timeout_ms=heartbeat_timeout_ms, raft_to_api=raft_to_api,
                            tls=tls, peer_tls=peer_tls, request_deadline_ms=request_deadline_ms,
                            max_connections=max_connections,
                            max_connections_per_ip=max_connections_per_ip,
                            join_ramp_s=join_ramp_s, join_timeout_s=join_timeout_s,
                            kv_events_endpoint=kv_events_endpoint)
    except OSError as exc:  # taken between the probe and here
        node.close()
        raise SystemExit(f"gcache-master: cannot bind --listen {listen}: "
                         f"{exc.strerror or exc}") from None
    except zmq.ZMQError as exc:
        node.close()
        raise SystemExit(f"gcache-master: cannot bind --kv-events-endpoint "
                         f"{kv_events_endpoint}: {exc}; pick a free port") from None
    svc.start()
    log.info("gcache-master serving", extra={"fields": {
        "listen": svc.address, "raft": raft_address(listen), "peers": peer_list,
        "data_dir": os.path.abspath(data_dir), "epoch": node.membership.epoch,
        "tls": "mtls" if require else "on" if tls is not None else "off",
        "join_ramp_s": join_ramp_s, "join_timeout_s": join_timeout_s,
        "raft_secret": secret_source}})
    stop, hup = threading.Event(), threading.Event()
    relay_signals(stop, hup)  # gcache.signals: never Event.set in a handler
    print(f"GCACHE_MASTER={svc.address}", flush=True)
    while not stop.wait(0.2):
        if hup.is_set():
            hup.clear()
            credentials.reload()
    log.info("stopping gcache-master")
    svc.stop()
    node.close()


if __name__ == "__main__":
    main()

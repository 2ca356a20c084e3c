"""``gcache-master``: one member of the 3-node Raft group that owns membership.

``--listen`` is the HTTP API address; the Raft port is the API port + 1.
``--peers`` lists the other masters' API addresses. Prints
``GCACHE_MASTER=host:port`` once the API serves; stops cleanly on SIGTERM.
``--credentials-file`` scopes the API (gcache.credentials); SIGHUP reloads it (a
bad file keeps the old credentials and logs why).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import click

from gcache.config import parse_bool
from gcache.credentials import CredentialStore
from gcache.errors import ConfigError
from gcache.logs import setup_logging
from gcache.network import check_bind
from gcache.tls import client_context, server_context

log = logging.getLogger("gcache.master")

RAFT_PORT_OFFSET = 1


def raft_address(api: str) -> str:
    host, port = api.rsplit(":", 1)
    return f"{host}:{int(port) + RAFT_PORT_OFFSET}"


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--listen", required=True, envvar="GCACHE_MASTER_LISTEN",
              help="HTTP API address HOST:PORT (the Raft port is PORT+1). [env GCACHE_MASTER_LISTEN]")
@click.option("--peers", default="", envvar="GCACHE_MASTER_PEERS",
              help="The other masters' API addresses, comma-separated. [env GCACHE_MASTER_PEERS]")
@click.option("--data-dir", required=True, type=click.Path(file_okay=False),
              envvar="GCACHE_MASTER_DATA_DIR",
              help="RocksDB state + Raft journal; keep it on a persistent volume.")
@click.option("--token", default="", envvar="GCACHE_TOKEN",
              help="Shared token: API auth and the Raft password. Required off loopback. "
                   "[env GCACHE_TOKEN]")
@click.option("--credentials-file", default="", envvar="GCACHE_CREDENTIALS_FILE",
              help="TOML file of scoped credentials (see gcache.credentials); servers need "
                   "server = true, /admin and /status need admin on \"*\". Reloaded on "
                   "SIGHUP. [env GCACHE_CREDENTIALS_FILE]")
@click.option("--heartbeat-timeout-ms", default=3000, show_default=True, type=click.IntRange(100),
              envvar="GCACHE_HEARTBEAT_TIMEOUT_MS",
              help="A server silent this long is marked down (epoch moves).")
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
@click.option("--log-level", default="INFO", show_default=True, envvar="GCACHE_LOG_LEVEL")
@click.option("--log-format", type=click.Choice(["json", "text"]), default="json",
              show_default=True, envvar="GCACHE_LOG_FORMAT")
def main(listen: str, peers: str, data_dir: str, token: str, credentials_file: str,
         heartbeat_timeout_ms: int, tls_cert_file: str, tls_key_file: str, tls_ca_file: str,
         tls_require_client_cert: str, log_level: str, log_format: str) -> None:
    """Run a gcache-master (membership, heartbeats, discovery; never on the IO path)."""
    setup_logging(log_level, log_format)
    try:
        credentials = CredentialStore(credentials_file, token)
        # the token is also the Raft password (below), so off loopback it stays required
        # even with a credentials file, until the masters get a Raft secret of their own
        check_bind(listen, token)
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

    peer_list = [p.strip() for p in peers.split(",") if p.strip() and p.strip() != listen]
    raft_to_api = {raft_address(a): a for a in [listen, *peer_list]}
    # pysyncobj pickles on the wire: always set a password. Loopback dev clusters without a
    # token share a fixed one; off loopback a token is required (checked above).
    password = token or "gcache-loopback-dev"
    node = RaftNode(raft_address(listen), [raft_address(p) for p in peer_list], data_dir,
                    password)
    svc = MasterService(node, listen=listen, token=token, credentials=credentials,
                        heartbeat_timeout_ms=heartbeat_timeout_ms, raft_to_api=raft_to_api,
                        tls=tls, peer_tls=peer_tls)
    svc.start()
    log.info("gcache-master serving", extra={"fields": {
        "listen": svc.address, "raft": raft_address(listen), "peers": peer_list,
        "data_dir": os.path.abspath(data_dir), "epoch": node.membership.epoch,
        "tls": "mtls" if require else "on" if tls is not None else "off"}})
    stop, hup = threading.Event(), threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: hup.set())
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

from __future__ import annotations

import gc

import pytest

from gcache.testing.cluster import Cluster


def pytest_collection_finish(session):
    """Keep what collection loaded (torch, sglang, hypothesis: ~740k objects for the whole
    suite) out of the cyclic collector. A full collection of that heap holds the GIL for
    0.43 s on an idle box, more under a loaded CI run, and it lands in whichever test
    allocates next; the deadline tests bound calls at a few hundred ms. Objects made by
    the tests are still collected as before."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    gc.unfreeze()  # the interpreter's own teardown collects everything, as before


@pytest.fixture
def make_cluster(tmp_path):
    """Factory for real-process clusters; every cluster is closed and checked for zombies."""
    made: list[Cluster] = []

    def make(n: int = 1, memory: str = "64MiB", **kw) -> Cluster:
        kw.setdefault("log_dir", str(tmp_path))
        c = Cluster(n, memory, **kw).start()
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def cluster(make_cluster):
    return make_cluster(1)


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory):
    """TLS material from trustme: a CA, a node certificate for 127.0.0.1 / localhost
    (servers and masters) and a client certificate, as ``TlsFiles`` PEM paths."""
    import trustme

    from gcache.testing.certs import TlsFiles

    d = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    node = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client.gcache.test")
    paths = TlsFiles(*(str(d / n) for n in ("ca.pem", "node.pem", "node.key", "client.pem",
                                            "client.key")))
    ca.cert_pem.write_to_path(paths.ca_file)
    node.cert_chain_pems[0].write_to_path(paths.cert_file)
    node.private_key_pem.write_to_path(paths.key_file)
    client.cert_chain_pems[0].write_to_path(paths.client_cert_file)
    client.private_key_pem.write_to_path(paths.client_key_file)
    return paths


@pytest.fixture(scope="session")
def other_ca_files(tmp_path_factory):
    """A second, unrelated trustme CA with its own client certificate (not trusted by
    ``tls_files``' servers)."""
    import trustme

    from gcache.testing.certs import TlsFiles

    d = tmp_path_factory.mktemp("tls-other")
    ca = trustme.CA()
    client = ca.issue_cert("intruder.gcache.test")
    paths = TlsFiles(str(d / "ca.pem"), "", "", str(d / "client.pem"), str(d / "client.key"))
    ca.cert_pem.write_to_path(paths.ca_file)
    client.cert_chain_pems[0].write_to_path(paths.client_cert_file)
    client.private_key_pem.write_to_path(paths.client_key_file)
    return paths

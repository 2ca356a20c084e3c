"""What the HTTP endpoints cost their process (a measurement driver, one line per run).

``watchers``: one master (``gcache.testing.cluster``) with ``--members`` registered
members and N raw-socket ``/view`` long-polls (``wait_ms=60000``, from 5 loopback source addresses, under the per-address
cap); prints the master's RSS and thread count before and with them, and the time from
one ``register`` until every watcher has read its whole answer.

``metrics``: one server with ``--metrics-listen``; prints its RSS, threads and the mean
time of 200 sequential scrapes of ``/metrics``.

    python -m gcache.bench.http_serving_cost watchers --n 1000
    python -m gcache.bench.http_serving_cost metrics

Not part of ``gcache-bench``: numbers for NOTES / RESULTS (issue 16 item 8).
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import time
import urllib.request

from gcache.discovery import MasterClient
from gcache.testing.cluster import Cluster, free_port

PER_ADDRESS = 200


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return int(next(ln.split()[1] for ln in fh if ln.startswith(key)))


def _answer_ok(s: socket.socket) -> bool:
    """Read one whole answer (Content-Length framed): is it a 200?"""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                      if ln.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += s.recv(65536)
    return head.startswith(b"HTTP/1.1 200")


def watchers(n: int, members: int = 0) -> str:
    with tempfile.TemporaryDirectory() as d, Cluster(
            0, masters=1, token="t", log_dir=d,
            # members that never heartbeat stay up for the run (no view change but ours)
            master_extra=["--max-connections", str(n + 100),
                          "--heartbeat-timeout-ms", "600000"]) as cl:
        host, port = cl.master_addresses[0].rsplit(":", 1)
        pid = cl.masters[0].proc.pid
        mc = MasterClient(cl.master_addresses, "t")
        for i in range(members):  # a view of this many members goes to every watcher
            mc.register(f"m-{i}", f"127.0.0.1:{10000 + i}", 1 << 30, f"boot-{i}")
        epoch = mc.view()["epoch"]
        time.sleep(1.0)
        rss0, thr0 = _status(pid, "VmRSS:"), _status(pid, "Threads:")
        socks = []
        try:
            for i in range(n):
                s = socket.create_connection((host, int(port)), timeout=30, source_address=(
                    f"127.0.0.{2 + i // PER_ADDRESS}", 0))
                s.sendall(f"GET /view?since={epoch}&wait_ms=60000 HTTP/1.1\r\nHost: m\r\n"
                          "Authorization: Bearer t\r\n\r\n".encode())
                socks.append(s)
            time.sleep(2.0)
            rss1, thr1 = _status(pid, "VmRSS:"), _status(pid, "Threads:")
            t0 = time.monotonic()
            mc.register("w-1", "127.0.0.1:1", 1 << 20, "boot-1")
            answered = sum(_answer_ok(s) for s in socks)
            wake_ms = (time.monotonic() - t0) * 1000
        finally:
            for s in socks:
                s.close()
    return (f"watchers={n} members={members} rss_before={rss0 / 1024:.1f}MiB rss_with={rss1 / 1024:.1f}MiB "
            f"grown={(rss1 - rss0) / 1024:.1f}MiB threads={thr0}->{thr1} answered={answered} "
            f"register_to_all_answered={wake_ms:.0f}ms")


def metrics(scrapes: int = 200) -> str:
    port = free_port()
    with tempfile.TemporaryDirectory() as d, Cluster(
            1, "32MiB", slab="1MiB", log_dir=d,
            server_extra=["--metrics-listen", f"127.0.0.1:{port}"]) as cl:
        pid = cl.servers[0].proc.pid
        url = f"http://127.0.0.1:{port}/metrics"
        urllib.request.urlopen(url, timeout=5).read()
        t0 = time.perf_counter()
        for _ in range(scrapes):
            urllib.request.urlopen(url, timeout=5).read()
        per_ms = (time.perf_counter() - t0) / scrapes * 1000
        return (f"server rss={_status(pid, 'VmRSS:') / 1024:.1f}MiB "
                f"threads={_status(pid, 'Threads:')} scrape={per_ms:.2f}ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["watchers", "metrics"])
    ap.add_argument("--n", type=int, default=1000, help="watchers to open")
    ap.add_argument("--members", type=int, default=0, help="members registered first")
    args = ap.parse_args()
    print(watchers(args.n, args.members) if args.what == "watchers" else metrics(), flush=True)


if __name__ == "__main__":
    main()

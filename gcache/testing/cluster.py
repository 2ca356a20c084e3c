"""Real-process local clusters for tests, ``gcache up`` and ``gcache-bench --local``.

``Cluster`` starts N ``gcache-server`` processes on loopback with unique
arena names, waits for each ``GCACHE_LISTEN=`` line, and on ``close()`` stops
them (SIGTERM, then SIGKILL), removes their arenas and checks that no process
is left behind. ``ServerProc`` is the nemesis handle: ``kill9``, ``terminate``,
``pause``/``resume`` (SIGSTOP/SIGCONT) and ``restart`` under the same name.
Masters share a random Raft secret per cluster, passed in their environment
(never argv, which ``ps`` shows; never to servers).

It spawns processes (``python -m gcache.server.cli``) and imports no server
or SDK code, so the core stays the bottom layer.
"""

from __future__ import annotations

import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from gcache.testing.certs import TlsFiles


class _Daemon:
    """A gcache daemon subprocess: spawn, wait for its ready line, and the nemesis."""

    READY = ""  # stdout line prefix printed once the daemon serves

    name: str
    log_dir: str | None
    proc: subprocess.Popen | None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        """The child's environment: ours, minus any Raft secret (only masters get one)."""
        return {k: v for k, v in os.environ.items()
                if k not in ("GCACHE_RAFT_SECRET", "GCACHE_RAFT_SECRET_FILE")}

    def spawn(self) -> None:
        stderr = subprocess.DEVNULL
        if self.log_dir:
            stderr = open(Path(self.log_dir) / f"{self.name}.log", "ab")
        self.proc = subprocess.Popen(self.argv(), stdout=subprocess.PIPE, stderr=stderr,
                                     text=True, bufsize=1, env=self.env())
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc, self._lines), daemon=True).start()

    def _wait_line(self, timeout: float) -> str:
        """The value after ``READY=``; kills the daemon and raises if it never comes."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.poll() is None:
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                continue
            if line.startswith(self.READY + "="):
                return line.split("=", 1)[1].strip()
        code = self.proc.poll()
        self.kill9()
        raise RuntimeError(f"{self.name} did not come up (exit {code}); "
                           f"see logs in {self.log_dir or 'stderr'}")

    def start(self, timeout: float = 30.0) -> str:
        self.spawn()
        return self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 30.0) -> str:
        return self._wait_line(timeout)

    @staticmethod
    def _pump(proc: subprocess.Popen, lines: queue.Queue) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.put(line)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self, timeout: float = 15.0) -> int | None:
        if not self.alive:
            return self.proc.poll() if self.proc else None
        self.resume()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            return None

    def kill9(self) -> None:
        if self.alive:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self, timeout: float = 2.0) -> None:
        """SIGSTOP, then wait (up to ``timeout``) until every thread has stopped: the
        signal is asynchronous, and a request sent at once could still be answered."""
        if self.alive:
            self.proc.send_signal(signal.SIGSTOP)
            end = time.monotonic() + timeout
            while time.monotonic() < end and not self._stopped():
                time.sleep(0.001)

    def _stopped(self) -> bool:
        """Every thread of the daemon is in the stopped state (Linux /proc)."""
        try:
            tasks = os.listdir(f"/proc/{self.proc.pid}/task")
            for tid in tasks:
                with open(f"/proc/{self.proc.pid}/task/{tid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
                        return False
        except OSError:
            return True  # gone, or no /proc: nothing to wait for
        return True

    def resume(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGCONT)

    def hup(self) -> None:
        """SIGHUP: the daemon re-reads its credentials file."""
        if self.alive:
            self.proc.send_signal(signal.SIGHUP)


class ServerProc(_Daemon):
    """One gcache-server process; ``restart`` keeps its name (arena) and port."""

    READY = "GCACHE_LISTEN"

    def __init__(self, name: str, memory: str, *, slab: str | None = None, token: str = "",
                 shm_dir: str = "/dev/shm", extra: list[str] | None = None,
                 log_dir: str | None = None, port: int = 0) -> None:
        self.name, self.memory, self.slab, self.token = name, memory, slab, token
        self.shm_dir, self.extra = shm_dir, list(extra or [])
        self.log_dir = log_dir
        # a restart keeps the port: one outside the ephemeral range (``free_port``), so
        # no outgoing connection can hold it when the server comes back
        self.port = port or free_port()
        self.proc = None
        self.address = ""

    @property
    def arena_path(self) -> str:
        return os.path.join(self.shm_dir, f"gcache-{self.name}.arena")

    def argv(self) -> list[str]:
        a = [sys.executable, "-m", "gcache.server.cli", "--listen", f"127.0.0.1:{self.port}",
             "--name", self.name, "--memory", self.memory, "--shm-dir", self.shm_dir,
             "--log-format", "text"]
        if self.slab:
            a += ["--slab-bytes", self.slab]
        if self.token:
            a += ["--token", self.token]
        return a + self.extra

    def wait_ready(self, timeout: float = 30.0) -> str:
        self.address = self._wait_line(timeout)
        self.port = int(self.address.rsplit(":", 1)[1])  # restarts keep the port
        return self.address

    def restart(self, timeout: float = 30.0) -> str:
        self.terminate()
        return self.start(timeout)

    def remove_arena(self) -> None:
        """The arena file and the ring epoch file next to it."""
        for path in (self.arena_path, self.arena_path[:-len(".arena")] + ".epoch"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _listener_ports() -> range:
    """Where test listeners take their ports: below the kernel's ephemeral range (or above
    it when there is no room below), so no outgoing connection is ever given one as its
    local port. A daemon restarted on its old port (a master's Raft port is its API port
    + 1) then never finds it taken by some other test's client socket. Each pytest-xdist
    worker gets a slice of its own."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    ports = range(10000, low - 1) if low - 1 >= 12000 else range(high + 1, 65534)
    # pytest-xdist workers (PYTEST_XDIST_WORKER "gw<i>" of PYTEST_XDIST_WORKER_COUNT) each
    # take their own slice: two workers' picks, free when picked and not yet bound, can
    # then never be the same port
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    try:
        count, i = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")), int(worker[2:])
    except ValueError:
        return ports
    if count > 1 and worker.startswith("gw") and 0 <= i < count:
        share = len(ports) // count
        return ports[i * share:(i + 1) * share - 1]  # p + 1 stays inside the slice
    return ports


_HANDED_OUT: set[int] = set()  # ports this process gave out: picked free, maybe not bound yet
_HANDED_LOCK = threading.Lock()


def _pick_port(pair: bool) -> int:
    """A random port ``p`` of ``_listener_ports`` free on 127.0.0.1 when asked (and
    ``p + 1`` with ``pair``) and never handed out before by this process (a cluster picks
    every port before its daemons bind them); a port the kernel picks when none is
    found."""
    import random
    import socket

    ports = _listener_ports()
    for _ in range(500):
        p = random.choice(ports)
        want = {p, p + 1} if pair else {p}
        with _HANDED_LOCK:
            if want & _HANDED_OUT:
                continue
            try:
                with socket.socket() as a, socket.socket() as b:
                    a.bind(("127.0.0.1", p))
                    if pair:
                        b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
            _HANDED_OUT.update(want)
        return p
    for _ in range(200):  # the range is exhausted (it never was in practice)
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            if not pair:
                return p
            if p >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
        return p
    raise RuntimeError("no free port pair found")


def free_port() -> int:
    """A port free on 127.0.0.1 when asked (for listeners a test names up front), outside
    the ephemeral range (``_listener_ports``)."""
    return _pick_port(pair=False)


def free_port_pair() -> int:
    """A port p with p and p+1 both free on 127.0.0.1 (a master's API and Raft ports),
    outside the ephemeral range (``_listener_ports``)."""
    return _pick_port(pair=True)


class MasterProc(_Daemon):
    """One gcache-master process; ``address`` is its API, the Raft port is API + 1."""

    READY = "GCACHE_MASTER"

    def __init__(self, name: str, port: int, peers: list[str], data_dir: str, *,
                 token: str = "", raft_secret: str = "", log_dir: str | None = None,
                 heartbeat_timeout_ms: int = 1500, join_ramp_s: float = 0.0,
                 extra: list[str] | None = None) -> None:
        self.name, self.port, self.peers, self.data_dir = name, port, peers, data_dir
        self.join_ramp_s = join_ramp_s
        self.token, self.raft_secret, self.log_dir = token, raft_secret, log_dir
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.extra = list(extra or [])
        self.address = f"127.0.0.1:{port}"
        self.proc = None

    def argv(self) -> list[str]:
        a = [sys.executable, "-m", "gcache.master.cli", "--listen", self.address,
             "--peers", ",".join(self.peers), "--data-dir", self.data_dir, "--log-format", "text",
             "--heartbeat-timeout-ms", str(self.heartbeat_timeout_ms),
             "--join-ramp-s", str(self.join_ramp_s)]
        return a + (["--token", self.token] if self.token else []) + self.extra

    def env(self) -> dict[str, str]:
        env = super().env()
        if self.raft_secret:
            env["GCACHE_RAFT_SECRET"] = self.raft_secret
        return env

    def wait_ready(self, timeout: float = 30.0) -> str:
        self._wait_line(timeout)
        return self.address


class Cluster:
    """N real gcache-server processes (and optionally M masters) on 127.0.0.1.

    With ``masters=M`` the servers register with the masters (``--masters``); use
    ``master_addresses`` for ``Client(masters=...)``. With ``tls`` (a ``TlsFiles`` from
    ``gcache.testing.certs``) servers and masters speak TLS only, and require client
    certificates when ``mtls``. The masters share ``raft_secret`` (a fresh random one
    unless given). Their ``join_ramp_s`` is 0 unless given (a new server is UP at once,
    as tests that are not about joins expect). Use as a context manager."""

    def __init__(self, n: int = 1, memory: str = "64MiB", *, slab: str | None = "1MiB",
                 token: str = "", shm_dir: str = "/dev/shm", extra: list[str] | None = None,
                 log_dir: str | None = None, prefix: str | None = None,
                 keep_arenas: bool = False, ready_timeout: float = 60.0, masters: int = 0,
                 data_dir: str | None = None, heartbeat_timeout_ms: int = 1500,
                 server_extra: list[str] | None = None, raft_secret: str | None = None,
                 master_extra: list[str] | None = None, tls: TlsFiles | None = None,
                 mtls: bool = False, join_ramp_s: float = 0.0) -> None:
        tag = prefix or f"t{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.tls = tls
        tls_flags = tls.server_flags(mtls) if tls is not None else []
        self.masters: list[MasterProc] = []
        self.raft_secret = raft_secret or secrets.token_hex(32)
        self._tmp = None
        if masters:
            import tempfile

            if data_dir is None:
                self._tmp = tempfile.mkdtemp(prefix="gcache-masters-")
                data_dir = self._tmp
            ports = []
            while len(ports) < masters:
                p = free_port_pair()
                if all(abs(p - q) > 1 for q in ports):
                    ports.append(p)
            addrs = [f"127.0.0.1:{p}" for p in ports]
            self.masters = [MasterProc(f"{tag}-m{i}", p, [a for a in addrs if a != addrs[i]],
                                       os.path.join(data_dir, f"m{i}"), token=token,
                                       raft_secret=self.raft_secret, log_dir=log_dir,
                                       heartbeat_timeout_ms=heartbeat_timeout_ms,
                                       join_ramp_s=join_ramp_s, extra=list(master_extra or []) + tls_flags)
                            for i, p in enumerate(ports)]
            extra = list(extra or []) + ["--masters", ",".join(addrs),
                                         "--heartbeat-interval-ms", "200"]
        extra = list(extra or []) + list(server_extra or []) + tls_flags
        self.keep_arenas = keep_arenas
        self.ready_timeout = ready_timeout
        self.servers = [ServerProc(f"{tag}-{i}", memory, slab=slab, token=token,
                                   shm_dir=shm_dir, extra=extra, log_dir=log_dir)
                        for i in range(n)]

    def start(self) -> "Cluster":
        try:
            for m in self.masters:
                m.spawn()
            for m in self.masters:
                m.wait_ready(self.ready_timeout)
            for s in self.servers:  # spawn all, then wait: they boot in parallel
                s.spawn()
            for s in self.servers:
                s.wait_ready(self.ready_timeout)
        except BaseException:
            self.close()
            raise
        return self

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    @property
    def master_addresses(self) -> list[str]:
        return [m.address for m in self.masters]

    def add_server(self, name: str, memory: str | None = None) -> ServerProc:
        """One more server like the first (same flags, same masters; ``memory``, else
        the first's), started; closed with the cluster."""
        first = self.servers[0]
        s = ServerProc(name, memory or first.memory, slab=first.slab, token=first.token,
                       shm_dir=first.shm_dir, extra=first.extra, log_dir=first.log_dir)
        self.servers.append(s)
        s.start(self.ready_timeout)
        return s

    def close(self) -> None:
        for s in self.servers:  # signal all first: they shut down in parallel
            if s.alive:
                s.resume()
                s.proc.send_signal(signal.SIGTERM)
        for s in self.servers:
            s.terminate()
        for m in self.masters:
            if m.alive:
                m.resume()
                m.proc.send_signal(signal.SIGTERM)
        for m in self.masters:
            m.terminate()
        leftovers = [s.name for s in [*self.servers, *self.masters] if s.alive]
        for s in self.servers:
            s.kill9()
            if not self.keep_arenas:
                s.remove_arena()
        for m in self.masters:
            m.kill9()
        if self._tmp:
            import shutil

            shutil.rmtree(self._tmp, ignore_errors=True)
        if leftovers:
            raise RuntimeError(f"servers did not exit: {leftovers}")

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Real-process local clusters for tests, ``gcache up`` and ``gcache-bench --local``.

``Cluster`` starts N ``gcache-server`` processes on loopback with unique
arena names, waits for each ``GCACHE_LISTEN=`` line, and on ``close()`` stops
them (SIGTERM, then SIGKILL), removes their arenas and checks that no process
is left behind. ``ServerProc`` is the nemesis handle: ``kill9``, ``terminate``,
``pause``/``resume`` (SIGSTOP/SIGCONT) and ``restart`` under the same name.

It spawns processes (``python -m gcache.server.cli``) and imports no server
or SDK code, so the core stays the bottom layer.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path


class ServerProc:
    def __init__(self, name: str, memory: str, *, slab: str | None = None, token: str = "",
                 shm_dir: str = "/dev/shm", extra: list[str] | None = None,
                 log_dir: str | None = None, port: int = 0) -> None:
        self.name, self.memory, self.slab, self.token = name, memory, slab, token
        self.shm_dir, self.extra = shm_dir, list(extra or [])
        self.log_dir = log_dir
        self.port = port
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self._lines: queue.Queue[str] = queue.Queue()

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

    def start(self, timeout: float = 30.0) -> str:
        self.spawn()
        return self.wait_ready(timeout)

    def spawn(self) -> None:
        stderr = subprocess.DEVNULL
        if self.log_dir:
            stderr = open(Path(self.log_dir) / f"{self.name}.log", "ab")
        self.proc = subprocess.Popen(self.argv(), stdout=subprocess.PIPE, stderr=stderr,
                                     text=True, bufsize=1)
        self._lines = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc, self._lines), daemon=True).start()

    def wait_ready(self, timeout: float = 30.0) -> str:
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                code = self.proc.poll()
                self.kill9()
                raise RuntimeError(f"gcache-server {self.name} did not come up (exit {code}); "
                                   f"see logs in {self.log_dir or 'stderr'}")
            try:
                line = self._lines.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            if line.startswith("GCACHE_LISTEN="):
                self.address = line.split("=", 1)[1].strip()
                self.port = int(self.address.rsplit(":", 1)[1])  # restarts keep the port
                return self.address

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

    def pause(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGCONT)

    def restart(self, timeout: float = 30.0) -> str:
        self.terminate()
        return self.start(timeout)

    def remove_arena(self) -> None:
        try:
            os.unlink(self.arena_path)
        except FileNotFoundError:
            pass


class Cluster:
    """N real gcache-server processes on 127.0.0.1. Use as a context manager."""

    def __init__(self, n: int = 1, memory: str = "64MiB", *, slab: str | None = "1MiB",
                 token: str = "", shm_dir: str = "/dev/shm", extra: list[str] | None = None,
                 log_dir: str | None = None, prefix: str | None = None,
                 keep_arenas: bool = False, ready_timeout: float = 60.0) -> None:
        tag = prefix or f"t{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.keep_arenas = keep_arenas
        self.ready_timeout = ready_timeout
        self.servers = [ServerProc(f"{tag}-{i}", memory, slab=slab, token=token,
                                   shm_dir=shm_dir, extra=extra, log_dir=log_dir)
                        for i in range(n)]

    def start(self) -> "Cluster":
        try:
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

    def close(self) -> None:
        for s in self.servers:  # signal all first: they shut down in parallel
            if s.alive:
                s.resume()
                s.proc.send_signal(signal.SIGTERM)
        for s in self.servers:
            s.terminate()
        leftovers = [s.name for s in self.servers if s.alive]
        for s in self.servers:
            s.kill9()
            if not self.keep_arenas:
                s.remove_arena()
        if leftovers:
            raise RuntimeError(f"servers did not exit: {leftovers}")

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

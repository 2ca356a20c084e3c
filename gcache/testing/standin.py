"""A stand-in peer for fault tests: a listening socket on 127.0.0.1 whose connections
are each served on their own daemon thread by the subclass's ``serve(sock)``. Tests build
hostile or scripted servers on it (wrong replies, malformed streams) without each
re-writing the accept loop."""

from __future__ import annotations

import socket
import threading


class StandIn:
    """Listens on an ephemeral 127.0.0.1 port (``address``); ``close`` stops accepting."""

    def __init__(self) -> None:
        self.ls = socket.socket()
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(8)
        self.address = "127.0.0.1:%d" % self.ls.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(c,), daemon=True).start()

    def serve(self, c: socket.socket) -> None:
        """One connection (its own thread); the subclass's script."""
        raise NotImplementedError

    def close(self) -> None:
        self.ls.close()


class Proxy(StandIn):
    """A TCP proxy to ``target`` ("host:port"): each connection is piped both ways, and
    every chunk passes ``forward(data, down)`` (``down``: server -> client), which
    subclasses override to alter, hold or drop bytes in flight. Either side closing shuts
    both down; ``close`` also closes every piped socket."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.socks: list[socket.socket] = []
        super().__init__()

    def forward(self, data: bytes, down: bool) -> bytes:
        return data

    def serve(self, c: socket.socket) -> None:
        s = socket.create_connection(self.target)
        self.socks += [c, s]
        threading.Thread(target=self._pipe, args=(s, c, True), daemon=True).start()
        self._pipe(c, s, False)

    def _pipe(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
        try:
            while data := src.recv(1 << 20):
                dst.sendall(self.forward(data, down))
        except OSError:
            pass
        finally:
            for sk in (src, dst):
                try:
                    sk.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        super().close()
        for sk in self.socks:
            sk.close()

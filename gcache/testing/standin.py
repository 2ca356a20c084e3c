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

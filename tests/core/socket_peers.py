"""Peers for the differential tests of the native socket functions (``recv_views``,
``exchange``): a trickler that keeps a call short of its bytes, and the exception type
a call raised."""

from __future__ import annotations

import socket
import threading
from typing import Any


class Trickler:
    """While running, sends one byte every 10 ms on ``sock``: a peer that keeps a
    reader waiting without ever giving it what it needs (``with Trickler(a): ...``;
    ``start=False``: a silent peer, same shape)."""

    def __init__(self, sock: socket.socket, start: bool = True) -> None:
        self.sock, self.on = sock, start
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self.stop.wait(0.01):
            try:
                self.sock.send(b"x")
            except OSError:
                return

    def __enter__(self) -> "Trickler":
        if self.on:
            self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        if self.on:
            self.thread.join(5)


def raised(fn: Any, *args: Any) -> type | None:
    """The type of the exception ``fn(*args)`` raised, or None."""
    try:
        fn(*args)
    except Exception as exc:  # the type is what must match
        return type(exc)
    return None

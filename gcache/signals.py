"""Process signals as events, without running ``Event.set`` in a signal handler.

A Python signal handler runs on the main thread between two bytecodes. If the main
thread is at that moment inside ``Event.wait`` on the very event the handler sets (a
stop loop's ``stop.wait(0.2)``, a drain's wait), it holds that event's lock, and the
handler's ``set`` waits for it forever: the process ignores SIGTERM until SIGKILL (a
gcache-server did, once in a test teardown; a storm of SIGHUPs made it happen every
time). So the Python handlers here do nothing; the interpreter's C-level handler writes
each signal's number to a pipe (``signal.set_wakeup_fd``), and one daemon thread
("gcache-signals") reads it and sets the events, as any thread may.

``relay_signals`` is called once, from the main thread, by the program's entry point.
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["relay_signals"]


def relay_signals(stop: threading.Event, hup: threading.Event | None = None,
                  again: threading.Event | None = None) -> None:
    """SIGTERM and SIGINT set ``stop`` (and, once it is set, ``again``: a second signal);
    SIGHUP sets ``hup`` (left at its default when None). Main thread only."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)
    sigs = [signal.SIGTERM, signal.SIGINT] + ([signal.SIGHUP] if hup is not None else [])
    for sig in sigs:
        signal.signal(sig, lambda *_: None)  # not the default action; the pipe says which

    def relay() -> None:
        while True:
            for num in os.read(r, 64):
                if num in (signal.SIGTERM, signal.SIGINT):
                    if stop.is_set() and again is not None:
                        again.set()
                    stop.set()
                elif num == signal.SIGHUP and hup is not None:
                    hup.set()

    threading.Thread(target=relay, name="gcache-signals", daemon=True).start()

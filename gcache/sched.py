"""Background CPU priority for the threads of bulk movers.

Design. On a GPU host gcache shares a few cores with the engine, and on small hosts
(this project's test machine has two) a bulk copy at full speed and a foreground
request compete for the same CPU. A rate cap bounds the copy's *average* share, but not
when it runs: the scheduler (CFS, EEVDF) lets a running thread finish its slice before a
woken one gets the CPU, so a foreground request that wakes behind a handoff burst waits
up to a slice (a few ms), which is the whole p99 budget. ``SCHED_IDLE`` is the one
policy where a waking normal thread always preempts at once, and it needs no privilege.
So threads whose work is bulk and not latency-bound (the servers' handoff worker, the
dispatch threads of a ``Client(background=True)``, and the server connection threads
such a client asks for with the AUTH flag ``bg``) run under it.

Trade-off: a thread under ``SCHED_IDLE`` runs only on CPU time nobody else wants, so a
fully busy host starves it (the handoff's own deadlines then turn into retries), and an
unprivileged thread cannot go back to normal (Linux needs ``RLIMIT_NICE`` for that):
use it only for threads that stay bulk for their whole life.

Threads: ``background_thread`` acts on the calling thread only and never blocks.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("gcache.sched")

BACKGROUND_NICE = 19  # the fallback where SCHED_IDLE is refused or missing


def background_thread() -> str:
    """Lower the calling thread to background priority: ``"idle"`` (``SCHED_IDLE``),
    ``"nice"`` (nice 19, where ``SCHED_IDLE`` is unavailable) or ``""`` (neither is
    allowed here; the thread keeps its priority, which costs latency, not correctness)."""
    idle = getattr(os, "SCHED_IDLE", None)
    if idle is not None:
        try:
            os.sched_setscheduler(0, idle, os.sched_param(0))  # 0: this thread (Linux)
            return "idle"
        except OSError as exc:
            why = str(exc)
    else:
        why = "no SCHED_IDLE on this platform"
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        return "nice"
    except (OSError, AttributeError) as exc:
        log.debug("background priority refused (%s; %s): thread keeps its priority", why, exc)
        return ""

"""``wait_for``: poll a condition in a test until it holds or a timeout passes.

One helper for every test that waits on real processes (a view to converge, a metric
to move, a reservation to be freed), so the polling rule is written once.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from gcache.discovery import MasterUnavailable

#: what a condition may raise while the cluster settles (a master mid-election, a
#: server restarting, a view without the member yet); anything else propagates
SETTLING = (MasterUnavailable, OSError, KeyError, ValueError)


def wait_for(pred: Callable[[], Any], timeout: float, step: float = 0.05,
             retry_on: tuple[type[BaseException], ...] = SETTLING) -> Any:
    """Call ``pred`` every ``step`` seconds until it returns something truthy, and
    return that; exceptions in ``retry_on`` count as "not yet". AssertionError (naming
    the last value or exception) when ``timeout`` seconds pass first."""
    end = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = pred()
            if last:
                return last
        except retry_on as exc:
            last = exc
        if time.monotonic() >= end:
            raise AssertionError(f"condition not met within {timeout}s (last: {last!r})")
        time.sleep(step)

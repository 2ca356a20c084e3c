"""The bulk fold of one-slice keys gives exactly what the per-slice fold gives.

``IntoBatch.fold_frame`` folds a batch whose every key is one slice in bulk
(``_fold_whole``: one lock hold, no per-key tuple or ``finalize`` call). It must give
the same per-key results, the same checksum counters and the same exactly-once
callbacks as the per-slice path (``slice_status`` -> ``fold`` -> ``finalize``), for
any mix of statuses, wrong sizes, landed hashes (right, wrong, absent), wrong server
checksums and duplicate or late frames. Hypothesis drives both on the same input.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from gcache.hashing import checksum
from gcache.sdk.batch import Checksums, IntoBatch
from gcache.sdk.transports.base import ItemResult, Work
from gcache.protocol import Op
from gcache.status import Status

pytestmark = [pytest.mark.unit]


class _Sender:
    def send(self, batch, routed, retried=False) -> None:  # pragma: no cover
        raise AssertionError("nothing is re-sent")

    def reroute(self, batch, work, moved) -> None:  # pragma: no cover
        raise AssertionError("no NOT_OWNER here")


_answer = st.fixed_dictionaries({
    "status": st.sampled_from([Status.OK, Status.OK, Status.OK, Status.MISS, Status.TIMEOUT,
                               Status.CORRUPT]),
    "total": st.sampled_from(["n", "n", "short", "long", "zero"]),
    "nbytes": st.sampled_from(["n", "n", "less", "total"]),
    "landed": st.sampled_from([None, "right", "right", "wrong"]),
    "csum": st.sampled_from(["right", "right", "wrong"]),
})


def _run(sliced: bool, sizes: list[int], frames: list[list[int]], answers: list[dict],
         verify: bool):
    keys = [b"k%d" % i for i in range(len(sizes))]
    bufs = [bytearray(bytes([i % 251 + 1]) * n) for i, n in enumerate(sizes)]
    views = [memoryview(b) for b in bufs]
    checks = Checksums(verify)
    calls: list = []
    done: list = []
    b = IntoBatch(keys, views, checks, 0.0, _Sender(), done.append,
                  lambda i, k, r: calls.append((i, r)))
    items = b.route(["x"] * len(keys), 1 << 20)["x"]
    b.sliced = sliced  # False: the bulk path; True: the per-slice path
    for frame, ans in zip(frames, answers):
        its = [items[i] for i in frame]
        res = []
        for i in frame:
            n, a = sizes[i], ans[i]
            total = {"n": n, "short": max(0, n - 1), "long": n + 1, "zero": 0}[a["total"]]
            nbytes = {"n": n, "less": max(0, n - 1), "total": min(n, total)}[a["nbytes"]]
            right = checksum(bufs[i])
            csum = right if a["csum"] == "right" else right ^ 1
            landed = None if a["landed"] is None else right if a["landed"] == "right" \
                else right ^ 2
            res.append(ItemResult(a["status"], total, 7, nbytes, None, csum, landed))
        b.frame_done(Work(Op.GET, b"ns", its, 0.0, None), res)
    return (b.results, sorted(calls), done, dict(checks.counters), b.remaining)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n_keys=st.integers(1, 6), verify=st.booleans())
@pytest.mark.timeout(120)
def test_whole_key_fold_matches_slice_fold(data, n_keys, verify):
    sizes = data.draw(st.lists(st.integers(1, 64), min_size=n_keys, max_size=n_keys))
    order = data.draw(st.permutations(range(n_keys)))
    cut = data.draw(st.integers(0, n_keys))
    frames = [list(order[:cut]), list(order[cut:])]
    # duplicates and late answers: some keys answered again in a third frame
    frames.append(data.draw(st.lists(st.sampled_from(range(n_keys)), max_size=3,
                                     unique=True)))
    answers = [[data.draw(_answer) for _ in range(n_keys)] for _ in frames]
    bulk = _run(False, sizes, frames, answers, verify)
    per_slice = _run(True, sizes, frames, answers, verify)
    assert bulk == per_slice
    assert bulk[4] == 0 and len(bulk[2]) == 1 and len(bulk[1]) == n_keys  # once each

"""A few seconds of the atheris decoder harness (fuzz_protocol_decoder.py) in the suite.

The ``test`` extra installs atheris (through ``fuzz``); skipped only without it.
Seeds are valid frames of the data ops, so the fuzzer starts past the magic and CRC.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from gcache.protocol import Op, encode_frame

pytest.importorskip("atheris")

pytestmark = [pytest.mark.unit]

HARNESS = Path(__file__).with_name("fuzz_protocol_decoder.py")


def _seed(frame: bytes) -> bytes:
    b = bytearray(frame)
    b[18] |= 1  # odd reserved byte: the harness fixes the CRC of mutated inputs
    return bytes(b)


SEEDS = [
    encode_frame(Op.PUT, 1, {"ns": b"n", "items": [[b"k", 4, 0, 4, 0]]}, 4) + b"abcd",
    encode_frame(Op.GET, 2, {"ns": b"n", "items": [[b"k", 0, 10, 0]]}),
    encode_frame(Op.EXISTS, 3, {"ns": b"n", "items": [b"k", b"j"]}),
    encode_frame(Op.COMMIT, 4, {"slots": [1], "abort": []}),
]


@pytest.mark.timeout(90)
def test_decoder_survives_a_few_seconds_of_coverage_guided_fuzzing(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, frame in enumerate(SEEDS):
        (corpus / f"seed{i}").write_bytes(_seed(frame))
    # libFuzzer's RSS guard reads the peak RSS, which a child inherits from this process
    # across fork and exec: give it this process's peak plus the harness's own budget, or
    # a long pytest run (GiBs of arenas and torch) trips it before the first input.
    inherited_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    r = subprocess.run([sys.executable, str(HARNESS), "-max_total_time=5", "-max_len=512",
                        "-seed=1", f"-rss_limit_mb={inherited_mb + 1024}",
                        f"-artifact_prefix={tmp_path}/", str(corpus)],
                       capture_output=True, text=True, timeout=80)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "Done" in r.stderr, r.stderr[-2000:]

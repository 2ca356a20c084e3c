"""Coverage-guided (atheris) fuzzing of the wire decoder in gcache/protocol.py.

Run it by hand for as long as you like (atheris: the ``fuzz`` extra, part of ``test``):

    python tests/fuzz/fuzz_protocol_decoder.py -max_total_time=600 [corpus_dir]

``make test`` runs it for a few seconds through tests/fuzz/test_decoder_fuzz_smoke.py
(which skips only where atheris is not installed: outside the ``test`` extra).

One input is a byte stream as a peer would send it. The properties:

* ``read_frame`` over a real socket pair either returns a frame whose lengths respect
  ``Limits`` and whose header CRC checks out, or raises ``ProtocolError`` (malformed)
  or ``ConnectionError`` (truncated): never anything else, never a hang;
* ``decode_meta`` of any bytes returns a value or raises ``ProtocolError``;
* the item checks (``check_items``, ``parse_put_items``, ``check_key``,
  ``check_namespace``) accept only what they promise (non-empty bounded keys, bounded
  item counts, lengths that add up) and reject the rest with ``ProtocolError``;
* a header the decoder accepted re-encodes (``encode_frame``) to a frame that decodes
  to the same value.
"""

from __future__ import annotations

import socket
import sys
import zlib

import atheris

# only our modules: instrumenting numpy (imported by gcache.native) took ~50 s of start-up
with atheris.instrument_imports(include=["gcache"]):
    from gcache.errors import ProtocolError
    from gcache.protocol import (PREFIX_SIZE, Limits, check_items, check_key,
                                 check_namespace, decode_meta, decode_prefix, encode_frame,
                                 parse_put_items, read_frame)

# small limits, so the fuzzer reaches every bound with short inputs
LIM = Limits(max_key_bytes=8, max_namespace_bytes=8, max_value_bytes=1 << 16,
             max_batch_items=8, max_header_bytes=4096, max_frame_bytes=1 << 16)


def _read(data: bytes) -> tuple:
    """read_frame over a real socket pair holding ``data`` then EOF."""
    a, b = socket.socketpair()
    try:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        b.settimeout(5)
        return read_frame(b, LIM)
    finally:
        a.close()
        b.close()


def check_meta(meta) -> None:
    try:
        items = check_items(meta, LIM)
    except ProtocolError:
        return
    assert isinstance(meta, dict) and isinstance(items, list)
    assert len(items) <= LIM.max_batch_items
    try:
        ns = check_namespace(meta.get("ns", b""), LIM)
        assert isinstance(ns, bytes) and len(ns) <= LIM.max_namespace_bytes
    except ProtocolError:
        pass
    for it in items:
        try:
            k = check_key(it, LIM)
            assert isinstance(k, bytes) and 0 < len(k) <= LIM.max_key_bytes
        except ProtocolError:
            pass
    try:
        parsed = parse_put_items(items, LIM)
    except ProtocolError:
        return
    for p in parsed:
        key, tl, off, ln, pid = p[:5]  # a newer item may carry more (a checksum)
        assert 0 < len(key) <= LIM.max_key_bytes
        assert min(tl, off, ln, pid) >= 0 and off + ln <= tl


def TestOneInput(data: bytes) -> None:
    # the prefix alone
    try:
        fh = decode_prefix(data[:PREFIX_SIZE], LIM)
        assert fh.header_len <= LIM.max_header_bytes
        assert fh.payload_len <= LIM.max_frame_bytes
    except ProtocolError:
        pass
    # the header alone
    try:
        meta = decode_meta(data)
    except ProtocolError:
        meta = None
    else:
        check_meta(meta)
    # the whole stream, as a peer sends it; when the (ignored) reserved field is odd, with
    # the CRC made to match, so the fuzzer gets past the CRC check to the header decoder
    if len(data) >= PREFIX_SIZE and data[18] & 1:
        hlen = int.from_bytes(data[20:24], "little")
        crc = zlib.crc32(data[PREFIX_SIZE:PREFIX_SIZE + hlen], zlib.crc32(data[:32]))
        data = data[:32] + crc.to_bytes(4, "little") + data[PREFIX_SIZE:]
    try:
        fh, meta = _read(data)
    except (ProtocolError, ConnectionError):
        return
    assert fh.header_len <= LIM.max_header_bytes and fh.payload_len <= LIM.max_frame_bytes
    check_meta(meta)
    try:
        frame = encode_frame(fh.opcode, fh.request_id, meta, fh.payload_len)
    except (TypeError, ValueError, OverflowError):
        return  # e.g. a map with float keys msgpack decodes but will not re-encode
    fh2, meta2 = _read(frame)
    assert (fh2.opcode, fh2.request_id, fh2.payload_len) == (fh.opcode, fh.request_id,
                                                              fh.payload_len)
    assert repr(meta2) == repr(meta)  # repr: NaN != NaN, yet both decode the same


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

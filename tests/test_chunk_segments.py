"""Chunks with one checksum per segment (format version 2): layer-by-layer verification."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hashing import Namespace, chunk_keys
from storage.codec import (
    HEADER_SIZE,
    VERSION,
    VERSION_SEGMENTS,
    ChunkError,
    decode_chunk,
    decode_header,
    encode_chunk,
)

NS = Namespace(model="test/segments", dtype="bfloat16", layout="test", chunk_tokens=16)
TOKENS = list(range(16))
KEY = chunk_keys(TOKENS, NS)[0]
SIZES = [4096, 4096, 1024, 3072]


def payload() -> bytes:
    return os.urandom(sum(SIZES))


def test_segments_round_trip_and_each_verifies_alone():
    data = payload()
    blob = encode_chunk(KEY, TOKENS, data, {"layers": 4}, segments=SIZES)
    chunk = decode_chunk(blob, KEY, TOKENS)
    assert int.from_bytes(blob[8:10], "little") == VERSION_SEGMENTS
    assert [(o, n) for o, n, _ in chunk.header.segments] == [(0, 4096), (4096, 4096),
                                                             (8192, 1024), (9216, 3072)]
    for i, (offset, length, _) in enumerate(chunk.header.segments):
        chunk.header.verify_segment(i, data[offset : offset + length])
    # the whole-payload checksum is the same as a version 1 chunk's: whole reads unchanged
    plain = decode_header(encode_chunk(KEY, TOKENS, data, {"layers": 4}))
    assert plain.payload_checksum == chunk.header.payload_checksum and plain.segments == ()
    assert chunk.meta == {"layers": 4}


def test_version_1_chunks_still_decode_and_verify():
    data = payload()
    blob = encode_chunk(KEY, TOKENS, data)
    assert int.from_bytes(blob[8:10], "little") == VERSION
    chunk = decode_chunk(blob, KEY, TOKENS)
    assert chunk.header.segments == () and bytes(chunk.payload) == data
    with pytest.raises(ChunkError, match="no segment"):
        chunk.header.verify_segment(0, data)


def test_every_corrupt_byte_of_a_segment_fails_that_segment_only():
    data = bytearray(payload())
    header = decode_header(encode_chunk(KEY, TOKENS, bytes(data), segments=SIZES))
    rng = np.random.default_rng(0)
    for pos in [0, 4095, 4096, 9215, 9216, len(data) - 1, *rng.integers(0, len(data), 40)]:
        bad = bytearray(data)
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        failed = []
        for i, (offset, length, _) in enumerate(header.segments):
            try:
                header.verify_segment(i, bad[offset : offset + length])
            except ChunkError:
                failed.append(i)
        owner = next(i for i, (o, n, _) in enumerate(header.segments) if o <= pos < o + n)
        assert failed == [owner]
    with pytest.raises(ChunkError, match="bytes, header says"):
        header.verify_segment(0, data[:100])


def test_a_corrupt_segment_table_is_a_corrupt_header():
    blob = bytearray(encode_chunk(KEY, TOKENS, payload(), segments=SIZES))
    table = blob.index(b"\x04\x00\x00\x00", 52 + len(KEY) + 4 * len(TOKENS))
    for pos in range(table, table + 4 + 16 * len(SIZES)):
        bad = bytearray(blob)
        bad[pos] ^= 0x10
        with pytest.raises(ChunkError):
            decode_header(bad[:HEADER_SIZE], KEY)


@pytest.mark.parametrize("segments, why", [
    ([100, 200], "cover"), ([0, sum(SIZES)], "positive"), ([], "positive"),
    ([1] * 8193, "1 to 8192"),
])
def test_segments_must_cover_the_payload_exactly(segments, why):
    with pytest.raises(ChunkError, match=why):
        encode_chunk(KEY, TOKENS, payload() if why != "1 to 8192" else b"x" * 8193,
                     segments=segments)


def test_a_header_with_many_segments_grows_and_keeps_the_payload_aligned():
    data = os.urandom(600 * 8)
    blob = encode_chunk(KEY, TOKENS, data, segments=[8] * 600)
    header = decode_header(blob, KEY)
    assert header.header_len % HEADER_SIZE == 0 and header.header_len > HEADER_SIZE
    assert len(header.segments) == 600
    assert bytes(blob[header.header_len :]) == data

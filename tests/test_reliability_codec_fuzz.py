"""Hostile bytes against the chunk decoder: only ChunkError ever escapes, and nothing but
the exact encoded chunk decodes. Hypothesis drives structured inputs (including headers
with *valid* checksums over garbage fields, which reach the field parsers); atheris adds
coverage-guided mutation in a subprocess when it is installed."""

from __future__ import annotations

import importlib.util
import json
import struct
import subprocess
import sys

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.faults import chunk_for
from storage.codec import _FIXED, _HCHECK_OFFSET, MAGIC, ChunkError, decode_chunk, decode_header

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEY, BLOB = chunk_for(8, 0, 8192)


def decodes(data: bytes, key: str | None = None) -> bool:
    try:
        decode_chunk(data, key)
    except ChunkError:
        return False
    return True


@FUZZ
@given(st.binary(max_size=10_000))
def test_arbitrary_bytes_raise_only_chunk_error(data: bytes):
    assert not decodes(data)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(BLOB) - 1), st.integers(0, 255)), min_size=1,
                max_size=16))
def test_mutated_chunk_decodes_only_if_unchanged(edits: list[tuple[int, int]]):
    data = bytearray(BLOB)
    for pos, value in edits:
        data[pos] = value
    assert decodes(bytes(data), KEY) == (bytes(data) == BLOB)


@FUZZ
@given(st.integers(0, len(BLOB)), st.binary(max_size=5000))
def test_truncated_or_extended_chunk_never_decodes(cut: int, tail: bytes):
    data = BLOB[:cut] + tail
    assert decodes(data, KEY) == (data == BLOB)


@st.composite
def checksummed_headers(draw: st.DrawFn) -> bytes:
    """A header with the right magic and a valid header checksum, but fuzzed fields."""
    hlen = draw(st.sampled_from([4096, 8192, 4095, 0, 2**31]))
    klen = draw(st.integers(0, 5000))
    ntok = draw(st.integers(0, 2000))
    mlen = draw(st.integers(0, 5000))
    buf = bytearray(max(4096, min(hlen, 8192)))
    _FIXED.pack_into(
        buf, 0, MAGIC, draw(st.sampled_from([1, 1, 2])), draw(st.sampled_from([0, 0, 1])),
        hlen, draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 2**64 - 1)), 0, klen, 0,
        ntok, mlen,
    )
    body = draw(st.one_of(
        st.binary(max_size=4000),
        st.builds(lambda k, m: k + m, st.text(max_size=60).map(str.encode),
                  st.sampled_from([b"{}", b"[]", b"null", b'{"a":', json.dumps({"x": 1}).encode()])),
    ))
    end = min(len(buf), _FIXED.size + len(body))
    buf[_FIXED.size : end] = body[: end - _FIXED.size]
    struct.pack_into("<Q", buf, _HCHECK_OFFSET, xxhash.xxh3_64_intdigest(bytes(buf), seed=0))
    return bytes(buf) + draw(st.binary(max_size=2000))


@FUZZ
@given(checksummed_headers())
def test_checksummed_garbage_headers_raise_only_chunk_error(data: bytes):
    for call in (lambda: decode_header(data), lambda: decode_chunk(data)):
        try:
            call()
        except ChunkError:
            pass


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris not installed")
def test_atheris_coverage_guided_fuzzing_finds_no_crash():
    done = subprocess.run(
        [sys.executable, "-m", "bench.faults", "fuzz-codec", "--runs", "20000"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Done 20000 runs" in done.stderr

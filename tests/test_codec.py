"""The chunk object format: round trips, aligned payloads, and every corruption rejected."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hashing import Namespace, chunk_keys
from storage import codec
from storage.codec import (
    ALIGN,
    HEADER_SIZE,
    ChunkError,
    decode_chunk,
    decode_header,
    encode_chunk,
)

NS = Namespace(model="m", dtype="float32", layout="l", chunk_tokens=8)
TOKENS = list(range(40, 48))
KEY = chunk_keys(TOKENS, NS)[0]


def test_round_trip_keeps_key_tokens_meta_and_payload():
    payload = np.arange(1000, dtype=np.float32)
    blob = encode_chunk(KEY, TOKENS, payload, {"dtype": "float32", "shape": [1000]})
    chunk = decode_chunk(blob, KEY, TOKENS)
    assert chunk.key == KEY
    assert list(chunk.token_ids) == TOKENS
    assert chunk.meta == {"dtype": "float32", "shape": [1000]}
    assert np.array_equal(np.frombuffer(chunk.payload, dtype=np.float32), payload)


def test_payload_starts_at_offset_4096():
    blob = encode_chunk(KEY, TOKENS, b"\xab" * 10)
    assert len(blob) == HEADER_SIZE + 10
    assert blob[HEADER_SIZE:] == b"\xab" * 10


def test_long_token_lists_grow_the_header_in_4k_steps_keeping_alignment():
    ns = Namespace(model="m", dtype="f", layout="l", chunk_tokens=2048)
    tokens = list(range(2048))
    key = chunk_keys(tokens, ns)[0]
    blob = encode_chunk(key, tokens, b"x" * 100)
    header = decode_header(blob, key)
    assert header.header_len % ALIGN == 0 and header.header_len > HEADER_SIZE
    assert bytes(decode_chunk(blob, key, tokens).payload) == b"x" * 100


def test_wrong_key_or_tokens_are_rejected():
    blob = encode_chunk(KEY, TOKENS, b"payload")
    other_key = chunk_keys(list(range(8)), NS)[0]
    with pytest.raises(ChunkError, match="expected"):
        decode_chunk(blob, other_key)
    with pytest.raises(ChunkError, match="other tokens"):
        decode_chunk(blob, KEY, [t + 1 for t in TOKENS])


def test_tokens_match_in_every_form_an_engine_hands_them():
    header = decode_header(encode_chunk(KEY, TOKENS, b"payload"), KEY)
    as_u32 = np.asarray(TOKENS, dtype="<u4")
    for same in (TOKENS, tuple(TOKENS), as_u32, as_u32.astype(np.int64), as_u32[None, :],
                 np.frombuffer(as_u32.tobytes(), dtype="<u4")):
        assert header.matches_tokens(same)
    for other in ([*TOKENS[:-1], TOKENS[-1] + 1], TOKENS[:-1], as_u32[:-1], as_u32 + 1,
                  np.concatenate([as_u32, as_u32[:1]])):
        assert not header.matches_tokens(other)


def test_truncated_and_extended_blobs_are_rejected():
    blob = encode_chunk(KEY, TOKENS, b"p" * 5000)
    for cut in (0, 10, 100, HEADER_SIZE - 1, HEADER_SIZE, len(blob) - 1):
        with pytest.raises(ChunkError):
            decode_chunk(blob[:cut], KEY)
    with pytest.raises(ChunkError):
        decode_chunk(blob + b"\x00", KEY)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pos=st.integers(min_value=0), flip=st.integers(min_value=1, max_value=255),
       payload=st.binary(min_size=1, max_size=3000))
def test_every_single_byte_corruption_is_rejected(pos, flip, payload):
    blob = bytearray(encode_chunk(KEY, TOKENS, payload, {"a": 1}))
    pos %= len(blob)
    blob[pos] ^= flip
    with pytest.raises(ChunkError):
        decode_chunk(bytes(blob), KEY)


def test_each_decode_gives_its_own_meta_even_where_the_parse_is_reused():
    blob = encode_chunk(KEY, TOKENS, b"0123456789", {"layout": "x", "segments": [5, 5]})
    first = decode_header(blob).meta
    first["layout"] = "changed by a caller"
    assert decode_header(blob).meta == {"layout": "x", "segments": [5, 5]}
    big = {"pad": "y" * 5000}  # parsed each time: not kept in memory
    assert decode_header(encode_chunk(KEY, TOKENS, b"0", big)).meta == big


def test_corruption_of_each_header_byte_is_rejected_exhaustively():
    blob = encode_chunk(KEY, TOKENS, b"0123456789", {"layout": "x"})
    for pos in range(HEADER_SIZE):
        bad = bytearray(blob)
        bad[pos] ^= 0x01
        with pytest.raises(ChunkError):
            decode_chunk(bytes(bad))


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=9000))
def test_arbitrary_bytes_only_ever_raise_chunk_error(data):
    with pytest.raises(ChunkError):
        decode_chunk(data)


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=600),
       payload=st.binary(max_size=2000),
       meta=st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=4))
def test_round_trip_property(tokens, payload, meta):
    ns = Namespace(model="m", dtype="u8", layout="l", chunk_tokens=len(tokens))
    key = chunk_keys(tokens, ns)[0]
    chunk = decode_chunk(encode_chunk(key, tokens, payload, meta), key, tokens)
    assert bytes(chunk.payload) == payload and chunk.meta == meta


@pytest.mark.parametrize("tail", ["\n", "\r", "\x00"])
def test_encode_refuses_a_key_with_a_trailing_control_character(tail):
    key = "0" * 16 + "/" + "1" * 32
    with pytest.raises(ChunkError, match="malformed key"):
        encode_chunk(key + tail, [1, 2, 3], b"x" * 10)


@pytest.mark.parametrize("meta", [{"pad": [{}] * 80_000}, {"pad": "y" * (70 << 10)},
                                  {"pad": [[1]] * 1100}])
def test_a_meta_that_could_parse_into_much_memory_is_refused_at_encode_and_decode(
        meta, monkeypatch):
    with pytest.raises(ChunkError, match="meta"):
        encode_chunk(KEY, TOKENS, b"0" * 10, meta)
    with monkeypatch.context() as m:  # as a forger would write it
        m.setattr(codec, "_check_meta_size", lambda raw: None)
        forged = encode_chunk(KEY, TOKENS, b"0" * 10, meta)
    with pytest.raises(ChunkError, match="meta"):
        decode_chunk(forged, KEY)


def test_a_parsed_header_is_charged_at_least_what_it_holds():
    meta = {"pad": [{}] * 1000, "text": ["ab"] * 3000}
    blob = encode_chunk(KEY, TOKENS, b"0" * 10, meta)
    tracemalloc.start()
    header = decode_header(blob, KEY)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert header.meta == meta
    assert held <= header.cost

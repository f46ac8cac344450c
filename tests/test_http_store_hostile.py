"""The http:// store facing a lying server: every reply is bounded and checked before use, so
a hostile reply is a miss on the hot path (or the one typed error `put`, `delete` and
`list_keys` have), never MemoryError, OverflowError, RecursionError, TypeError or wrong
bytes. The servers are scripted sockets on 127.0.0.1 that send what a kvserver never would."""

from __future__ import annotations

import json
import socket
import struct
import threading

import pytest
import xxhash

from storage import StoreFull, StoreUnavailable, open_store
from storage.codec import decode_header
from tests.store_helpers import make_chunks
from tests.test_http_store_client import OneReplyServer, ScriptedServer

NESTED = b"[" * 20_000 + b"]" * 20_000  # far deeper than any JSON parser's recursion limit


def reply(status: str, body: bytes = b"", *heads: str) -> bytes:
    extra = "".join(f"{h}\r\n" for h in heads)
    if not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in heads):
        extra += f"Content-Length: {len(body)}\r\n"
    return f"HTTP/1.1 {status}\r\n{extra}\r\n".encode() + body


def lookup_reply(answer: object) -> bytes:
    return reply("200 OK", json.dumps(answer).encode(), "Content-Type: application/json")


async def all_calls_miss(url: str, key: str) -> None:
    """get, get_into, exists and prefix_len against `url` each answer a plain miss."""
    store = open_store(f"{url}?timeout=5s&breaker_failures=1000")
    try:
        assert await store.get(key) is None
        assert await store.get_into(key, bytearray(1 << 20)) is None
        assert await store.exists([key, key]) == [False, False]
        assert await store.prefix_len([key, key]) == 0
        assert store.counters["hits"] == 0
    finally:
        await store.close()


HOSTILE_REPLIES = {
    "content_length_of_2_to_the_62": reply("200 OK", b"x" * 10, f"Content-Length: {1 << 62}"),
    "content_length_of_30_digits": reply("200 OK", b"x", "Content-Length: " + "9" * 30),
    "content_length_of_5000_digits": reply("200 OK", b"x", "Content-Length: " + "9" * 5000),
    "status_of_5000_digits": b"HTTP/1.1 " + b"2" * 5000 + b" OK\r\nContent-Length: 0\r\n\r\n",
    "chunk_size_of_2_to_the_59": reply("200 OK", b"800000000000000\r\nxx", "Transfer-Encoding: chunked"),
    "negative_chunk_size": reply("200 OK", b"-5\r\nxx", "Transfer-Encoding: chunked"),
    "chunk_size_with_underscores": reply("200 OK", b"1_0\r\nxx", "Transfer-Encoding: chunked"),
    "error_with_a_huge_chunk_size": reply("500 Oops", b"7ffffffffff\r\nxx", "Transfer-Encoding: chunked"),
    "error_with_nested_json": reply("503 Busy", b'{"error": ' + NESTED + b"}"),
    "error_with_a_non_string_message": reply("500 Oops", b'{"error": {"a": [1, 2]}}'),
    "error_with_non_utf8_json": reply("500 Oops", b'{"error": "\xff\xfe"}'),
    "lookup_nested_json": reply("200 OK", NESTED),
    "lookup_a_list": lookup_reply([1, 2]),
    "lookup_null": lookup_reply(None),
    "lookup_prefix_len_a_string": lookup_reply({"prefix_len": "2", "count": 2, "present": "Aw=="}),
    "lookup_prefix_len_a_float": lookup_reply({"prefix_len": 1.5, "count": 2, "present": "Aw=="}),
    "lookup_prefix_len_true": lookup_reply({"prefix_len": True, "count": 2, "present": "AQ=="}),
    "lookup_prefix_len_past_the_keys": lookup_reply({"prefix_len": 99, "count": 2, "present": "Aw=="}),
    "lookup_prefix_len_negative": lookup_reply({"prefix_len": -1, "count": 2, "present": "AA=="}),
    "lookup_prefix_len_of_5000_digits": reply("200 OK", b'{"prefix_len": ' + b"9" * 5000 + b"}"),
    "lookup_present_a_number": lookup_reply({"prefix_len": 0, "count": 2, "present": 5}),
    "lookup_present_not_base64": lookup_reply({"prefix_len": 0, "count": 2, "present": "!!"}),
    "lookup_present_not_ascii": lookup_reply({"prefix_len": 0, "count": 2, "present": "é"}),
    "lookup_bitmap_too_short": lookup_reply({"prefix_len": 0, "count": 2, "present": ""}),
    "lookup_bitmap_disagrees_with_prefix_len": lookup_reply(
        {"prefix_len": 2, "count": 2, "present": "AQ=="}),
    "lookup_count_of_other_keys": lookup_reply({"prefix_len": 2, "count": 3, "present": "Aw=="}),
    "lookup_missing_fields": lookup_reply({}),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_REPLIES))
async def test_a_hostile_reply_is_a_miss_for_every_read(ns, name):
    (key, _, _), = make_chunks(ns, 1)
    server = OneReplyServer(HOSTILE_REPLIES[name])
    try:
        await all_calls_miss(server.url, key)
    finally:
        server.close()


async def test_a_consistent_lookup_reply_is_still_believed(ns):
    """The checks above refuse lies, not answers: the same scripted server telling a
    coherent story gets its prefix_len through."""
    (key, _, _), = make_chunks(ns, 1)
    server = OneReplyServer(lookup_reply({"prefix_len": 1, "count": 2, "present": "AQ=="}))
    store = open_store(server.url)
    try:
        assert await store.prefix_len([key, key]) == 1
        assert await store.exists([key, key]) == [True, False]
    finally:
        await store.close()
        server.close()


def chunk_reply(blob: bytes, declared: int | None = None) -> bytes:
    n = len(blob) if declared is None else declared
    return reply("200 OK", blob, f"Content-Length: {n}")


async def test_verify_false_never_returns_a_blob_of_another_length(ns):
    (key, _, blob), = make_chunks(ns, 1, payload_size=5000)
    for body in (blob + b"trailing garbage", blob[:-10]):
        server = OneReplyServer(chunk_reply(body))
        store = open_store(f"{server.url}?verify=false&timeout=2s")
        try:
            assert await store.get(key) is None
            assert await store.get_into(key, bytearray(10_000)) is None
        finally:
            await store.close()
            server.close()
    server = OneReplyServer(chunk_reply(blob))
    store = open_store(f"{server.url}?verify=false")
    try:
        assert await store.get(key) == blob  # the honest reply still reads
    finally:
        await store.close()
        server.close()


async def test_a_chunk_over_max_chunk_is_refused_before_its_body_is_read(ns):
    (key, _, blob), = make_chunks(ns, 1, payload_size=64 * 1024)
    server = OneReplyServer(chunk_reply(blob))
    small = open_store(f"{server.url}?max_chunk=16KiB")
    large = open_store(f"{server.url}?max_chunk=1MiB")
    try:
        assert await small.get(key) is None
        assert await large.get(key) == blob
    finally:
        await small.close()
        await large.close()
        server.close()


async def test_a_body_claiming_a_gigabyte_allocates_nothing_of_that_size(ns):
    """A valid header for the key, then a Content-Length the header contradicts: the
    header is read first, so the gigabyte is never allocated."""
    (key, _, blob), = make_chunks(ns, 1, payload_size=5000)
    server = OneReplyServer(chunk_reply(blob, declared=(1 << 30) - 1))
    store = open_store(f"{server.url}?timeout=2s")
    try:
        assert await store.get(key) is None
        assert store.counters["corrupt"] == 1
    finally:
        await store.close()
        server.close()


def with_nested_meta(blob: bytes) -> bytes:
    """`blob` with its meta JSON replaced by a deeply nested object of the same length,
    and the header checksum recomputed: a header that checks, with a hostile meta."""
    header = decode_header(blob)
    buf = bytearray(blob)
    klen, ntok, mlen = struct.unpack_from("<H2xII", buf, 40)
    start = 52 + klen + 4 * ntok
    depth = (mlen - 7) // 2
    meta = b'{"a":' + b"[" * depth + b"]" * depth + b"}"
    buf[start : start + mlen] = meta.ljust(mlen, b" ")
    struct.pack_into("<Q", buf, 32, 0)
    struct.pack_into("<Q", buf, 32, xxhash.xxh3_64_intdigest(bytes(buf[: header.header_len]), seed=0))
    return bytes(buf)


async def test_a_chunk_header_with_deeply_nested_meta_is_a_miss(ns):
    (key, tokens, _), = make_chunks(ns, 1, payload_size=5000)
    from storage.codec import encode_chunk

    blob = encode_chunk(key, tokens, bytes(5000), {"pad": "x" * 20_000})
    server = OneReplyServer(chunk_reply(with_nested_meta(blob)))
    try:
        await all_calls_miss(server.url, key)
    finally:
        server.close()


class EndlessErrorServer(ScriptedServer):
    """Answers with an error whose chunked body never ends; counts the bytes it got out."""

    def __init__(self, status: str):
        self.status = status
        self.sent = 0
        self.done = threading.Event()
        super().__init__(socket.create_server(("127.0.0.1", 0)))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def answer(self, conn: socket.socket) -> None:
        if not conn.recv(65536):
            return
        conn.sendall(f"HTTP/1.1 {self.status}\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        piece = b"10000\r\n" + b"e" * 0x10000 + b"\r\n"
        try:
            while self.sent < 1 << 30:
                conn.sendall(piece)
                self.sent += len(piece)
        finally:
            self.done.set()


@pytest.mark.parametrize("status", ["404 Not Found", "507 Insufficient Storage"])
async def test_an_endless_error_body_is_cut_off_and_keeps_its_status(ns, status):
    (key, _, blob), = make_chunks(ns, 1)
    server = EndlessErrorServer(status)
    store = open_store(f"{server.url}?timeout=60s")
    try:
        if status.startswith("404"):
            assert await store.get(key) is None
        else:
            with pytest.raises(StoreFull):
                await store.put(key, blob)
        assert server.done.wait(10)
        # What the server got out before the client hung up: the client's 64 KiB bound
        # plus what the two sockets' kernel buffers hold, far below the 1 GiB it offered.
        assert server.sent < 64 << 20
    finally:
        await store.close()
        server.close()


@pytest.mark.parametrize("body", [NESTED, b'{"error": ' + NESTED + b"}", b"\xff" * 100])
async def test_put_and_delete_get_their_typed_error_for_any_error_body(ns, body):
    (key, _, blob), = make_chunks(ns, 1)
    full = OneReplyServer(reply("507 Insufficient Storage", body))
    down = OneReplyServer(reply("503 Service Unavailable", body))
    try:
        store = open_store(full.url)
        with pytest.raises(StoreFull):
            await store.put(key, blob)
        await store.close()
        store = open_store(down.url)
        with pytest.raises(StoreUnavailable):
            await store.put(key, blob)
        with pytest.raises(StoreUnavailable):
            await store.delete(key)
        await store.close()
    finally:
        full.close()
        down.close()


async def test_a_key_listing_yields_only_well_formed_keys(ns):
    chunks = make_chunks(ns, 3)
    good = [k for k, _, _ in chunks]
    body = "\n".join([good[0], "../../etc/passwd", good[1], "X" * 49, ""]).encode()
    body += b"\xff\xfe\x00\n" + b"  " + good[2].encode() + b"\r\n"
    server = OneReplyServer(reply("200 OK", body))
    store = open_store(server.url)
    try:
        assert [k async for k in store.list_keys()] == good
        assert store.counters["errors"] == 1
    finally:
        await store.close()
        server.close()


@pytest.mark.parametrize("hostile", [
    reply("200 OK", b"x", f"Content-Length: {1 << 62}"),
    reply("200 OK", b"7fffffffffffff\r\n", "Transfer-Encoding: chunked"),
    reply("200 OK", b"a" * 100_000),  # one over-long line
])
async def test_a_hostile_key_listing_is_store_unavailable(hostile):
    server = OneReplyServer(hostile)
    store = open_store(f"{server.url}?timeout=2s")
    try:
        with pytest.raises(StoreUnavailable):
            _ = [k async for k in store.list_keys()]
    finally:
        await store.close()
        server.close()


def _ranged_replies(blob: bytes, start: int, stop: int) -> dict[str, bytes]:
    """Lies in answer to `Range: bytes=start-(stop-1)` of the chunk `blob`."""
    part, total, n = blob[start:stop], len(blob), stop - start
    cr = f"Content-Range: bytes {start}-{stop - 1}/{total}"
    return {
        "range_ignored_whole_chunk_200": reply("200 OK", blob),
        "content_range_missing": reply("206 Partial Content", part),
        "content_range_of_another_range": reply(
            "206 Partial Content", part, f"Content-Range: bytes {start + 1}-{stop}/{total}"),
        "content_range_disagrees_with_length": reply(
            "206 Partial Content", part[:100], cr, "Content-Length: 100"),
        "total_of_2_to_the_62": reply(
            "206 Partial Content", part, f"Content-Range: bytes {start}-{stop - 1}/{1 << 62}"),
        "total_other_than_the_header_says": reply(
            "206 Partial Content", part, f"Content-Range: bytes {start}-{stop - 1}/{total + n}"),
        "body_cut_short": reply("206 Partial Content", part[:100], cr, f"Content-Length: {n}"),
    }


RANGED_LIES = sorted(_ranged_replies(b"\0" * 8192, 0, 4096))


@pytest.mark.parametrize("name", RANGED_LIES + ["header_of_another_key"])
async def test_a_hostile_reply_to_a_header_read_is_a_miss(ns, name):
    (key, _, blob), (other, _, other_blob) = make_chunks(ns, 2, payload_size=5000)
    replies = _ranged_replies(blob, 0, 4096)
    replies["header_of_another_key"] = reply(
        "206 Partial Content", other_blob[:4096], f"Content-Range: bytes 0-4095/{len(blob)}")
    server = OneReplyServer(replies[name])
    store = open_store(f"{server.url}?timeout=2s&breaker_failures=1000")
    try:
        assert await store.read_header(key) is None
    finally:
        await store.close()
        server.close()


@pytest.mark.parametrize("name", RANGED_LIES)
async def test_a_hostile_reply_to_a_payload_range_is_a_miss(ns, name):
    (key, _, blob), = make_chunks(ns, 1, payload_size=5000)
    header = decode_header(blob, key)
    start, stop = header.header_len + 1000, header.header_len + 3000
    server = OneReplyServer(_ranged_replies(blob, start, stop)[name])
    store = open_store(f"{server.url}?timeout=2s&breaker_failures=1000")
    try:
        assert await store.read_range_into(key, header, 1000, bytearray(2000)) is False
    finally:
        await store.close()
        server.close()

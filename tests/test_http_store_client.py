"""The http:// store: pooled, streaming into the caller's buffer, and a miss on any failure."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from storage import ConfigError, InvalidChunk, StoreFull, StoreUnavailable, open_store
from storage.base import PROBE_KEY
from storage.http import HttpStore
from tests import kvserver_fixtures
from tests.kvserver_fixtures import running_kvserver
from tests.store_helpers import make_chunks

kvserver_url = kvserver_fixtures.kvserver_url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_get_into_fills_the_callers_buffer_and_reuses_one_connection(kvserver_url, ns):
    chunks = make_chunks(ns, 4, payload_size=300_000)
    store = open_store(f"{kvserver_url}?pool=1")
    try:
        for key, _, blob in chunks:
            assert await store.put(key, blob)
        buf = bytearray(400_000)
        for key, _, blob in chunks:
            header = await store.get_into(key, buf)
            assert header is not None and header.key == key
            assert buf[: header.payload_len] == blob[header.header_len :]
        assert store.stats()["pooled_connections"] == 1
    finally:
        await store.close()


async def test_buffer_too_small_is_a_miss_and_the_next_request_still_works(kvserver_url, ns):
    (key, _, blob), = make_chunks(ns, 1, payload_size=100_000)
    store = open_store(kvserver_url)
    try:
        await store.put(key, blob)
        assert await store.get_into(key, bytearray(10)) is None
        assert await store.get(key) == blob
    finally:
        await store.close()


async def test_the_store_serves_its_caller_while_a_listing_is_read(kvserver_url, ns):
    """A listing is read as the caller takes its keys, on a connection of its own: with a
    pool of one, the caller can still fetch each key it is handed."""
    chunks = {key: blob for key, _, blob in make_chunks(ns, 5)}
    store = open_store(f"{kvserver_url}?pool=1&timeout=5s")
    try:
        for key, blob in chunks.items():
            await store.put(key, blob)
        fetched = {}
        async for key in store.list_keys():
            if key in chunks:
                fetched[key] = await store.get(key)
        assert fetched == chunks
    finally:
        await store.close()


async def test_large_batches_of_keys_are_split_into_several_lookups(kvserver_url, ns, monkeypatch):
    monkeypatch.setattr("storage.http.LOOKUP_BATCH", 3)
    chunks = make_chunks(ns, 8)
    store = open_store(kvserver_url)
    try:
        for key, _, blob in chunks[:7]:
            await store.put(key, blob)
        keys = [k for k, _, _ in chunks]
        assert await store.prefix_len(keys) == 7
        assert await store.exists(keys) == [True] * 7 + [False]
    finally:
        await store.close()


async def test_put_rejections_surface_as_typed_errors(ns):
    (key, _, blob), (other, _, _) = make_chunks(ns, 2, payload_size=64 * 1024)
    with running_kvserver("--store", "memory://", "--max-chunk-bytes", "16KiB") as server:
        store = open_store(server.url)
        try:
            with pytest.raises(InvalidChunk):
                await store.put(other, blob)  # checked here before anything is sent
            with pytest.raises(StoreFull, match="exceeds the limit"):
                await store.put(key, blob)
            assert await store.get(key) is None
        finally:
            await store.close()


async def test_dead_server_is_a_fast_miss_and_the_breaker_opens(ns):
    (key, _, blob), = make_chunks(ns, 1)
    store = open_store(f"http://127.0.0.1:{free_port()}?breaker_failures=2&breaker_cooldown=30s")
    try:
        assert await store.get(key) is None
        assert await store.prefix_len([key]) == 0
        assert store.stats()["breaker_open"]
        t0 = time.perf_counter()
        for _ in range(100):
            assert await store.get_into(key, bytearray(10)) is None
        assert time.perf_counter() - t0 < 5  # no connection attempts while open
        with pytest.raises(StoreUnavailable):
            await store.put(key, blob)
        assert store.counters["errors"] >= 2
    finally:
        await store.close()


async def test_probe_answers_for_itself_where_exists_answers_absent(kvserver_url):
    """`exists` of a dead server is a quiet "absent"; `probe` says the check did not get
    through, counts it and feeds the breaker like any request, and a tier list's probe
    fails when one tier's does. A live server's probe says nothing."""
    dead_url = f"http://127.0.0.1:{free_port()}?breaker_failures=2&breaker_cooldown=30s"
    dead, live, tiers = open_store(dead_url), open_store(kvserver_url), open_store(
        ["memory://", kvserver_url, f"http://127.0.0.1:{free_port()}"])
    try:
        assert await dead.exists([PROBE_KEY]) == [False]
        assert "lookup failed" in (await dead.probe() or "")
        assert dead.stats()["errors"] == 2 and dead.stats()["breaker_open"]
        assert "circuit open" in (await dead.probe() or "")
        assert await live.probe() is None
        assert await tiers.probe() is not None
    finally:
        for store in (dead, live, tiers):
            await store.close()


async def test_a_restarted_server_is_reached_again_through_the_pool(tmp_path, ns):
    """Pooled connections to the old process are dead; the client retries on a fresh one."""
    (key, _, blob), = make_chunks(ns, 1)
    port = str(free_port())
    flags = ["--store", f"file://{tmp_path}", "--port", port]
    store = open_store(f"http://127.0.0.1:{port}")
    try:
        with running_kvserver(*flags):
            await store.put(key, blob)
            assert await store.get(key) == blob
        with running_kvserver(*flags):
            assert await store.get(key) == blob
            assert store.counters["errors"] == 0
    finally:
        await store.close()


class ScriptedServer:
    """A listening socket whose connections `answer(conn)` serves one at a time, on a
    thread of its own (for replies a real kvserver never sends)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    self.answer(conn)
                except OSError:
                    pass

    def answer(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.sock.close()


class OneReplyServer(ScriptedServer):
    """Answers every request with the same raw bytes (for damaged replies)."""

    def __init__(self, reply: bytes):
        self.reply = reply
        super().__init__(socket.create_server(("127.0.0.1", 0)))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def answer(self, conn: socket.socket) -> None:
        if conn.recv(65536):
            conn.sendall(self.reply)


@pytest.mark.parametrize("damage", ["flip_payload_byte", "truncate", "wrong_key", "not_http"])
async def test_damaged_replies_are_misses_never_wrong_bytes(ns, damage):
    (key, _, blob), (other, _, other_blob) = make_chunks(ns, 2, payload_size=5000)
    body = bytearray(blob)
    if damage == "flip_payload_byte":
        body[-1] ^= 0xFF
    elif damage == "wrong_key":
        body = bytearray(other_blob)
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + bytes(body)
    if damage == "truncate":
        reply = reply[:-100]
    elif damage == "not_http":
        reply = b"SSH-2.0-OpenSSH\r\n\r\n"
    server = OneReplyServer(reply)
    store = open_store(f"{server.url}?timeout=2s")
    try:
        assert await store.get(key) is None
        assert await store.get_into(key, bytearray(10_000)) is None
        assert store.counters["hits"] == 0
    finally:
        await store.close()
        server.close()


async def test_a_hung_server_times_out_as_a_miss(ns):
    (key, _, _), = make_chunks(ns, 1)
    listener = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    try:
        store = open_store(f"http://127.0.0.1:{listener.getsockname()[1]}?timeout=300ms")
        t0 = time.perf_counter()
        assert await store.get(key) is None
        assert time.perf_counter() - t0 < 5
        await store.close()
    finally:
        listener.close()


def test_bad_urls_and_options_fail_at_open():
    for url in ["http://", "http://host:notaport", "http://user:pw@host:1",
                "http://h:1?pool=0", "http://h:1?timeout=soon", "http://h:1?colour=red",
                "http://h:1?token=two%20words"]:
        with pytest.raises(ConfigError):
            open_store(url)
    store = open_store("http://h:1/prefix?token=s3cret-token-value&pool=4")
    assert isinstance(store, HttpStore) and "s3cret" not in str(store)
    assert store.prefix == "/prefix" and store.pool_size == 4


async def test_one_store_survives_several_event_loops(kvserver_url, ns):
    (key, _, blob), = make_chunks(ns, 1)
    store = open_store(kvserver_url)

    async def roundtrip() -> bytes | None:
        await store.put(key, blob)
        return await store.get(key)

    assert await roundtrip() == blob
    assert await asyncio.to_thread(asyncio.run, roundtrip()) == blob
    await store.close()


def self_signed_cert(directory) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


async def test_https_with_a_trusted_ca_round_trips_and_an_untrusted_one_misses(tmp_path, ns):
    cert, key = self_signed_cert(tmp_path)
    chunks = make_chunks(ns, 3, payload_size=200_000)
    with running_kvserver("--store", "memory://", "--tls-cert", cert, "--tls-key", key) as server:
        assert server.url.startswith("https://")
        store = open_store(f"{server.url}?ca={cert}")
        untrusted = open_store(server.url)
        try:
            for k, _, blob in chunks:
                assert await store.put(k, blob) is True
            keys = [k for k, _, _ in chunks]
            assert await store.prefix_len(keys) == 3
            assert await store.get(keys[0]) == chunks[0][2]
            buf = bytearray(200_000)
            header = await store.get_into(keys[1], buf)
            assert header is not None and buf == chunks[1][2][header.header_len :]
            assert await untrusted.get(keys[0]) is None
            assert untrusted.counters["errors"] == 1
        finally:
            await store.close()
            await untrusted.close()


async def test_a_cancelled_read_drops_its_connection_and_the_store_goes_on(kvserver_url, ns):
    (key, _, blob), = make_chunks(ns, 1, payload_size=32 * 1024 * 1024)
    store = open_store(f"{kvserver_url}?pool=1")
    try:
        await store.put(key, blob)
        buf = bytearray(32 * 1024 * 1024)
        cancelled = 0
        # 0 s cancels before the request starts; 1 ms usually mid-transfer, but a fast
        # server may finish 32 MiB first, which is fine too: only the aftermath is checked.
        for delay in (0.0, 0.001, 0.002):
            try:
                await asyncio.wait_for(store.get_into(key, bytearray(len(buf))), delay)
            except TimeoutError:
                cancelled += 1
        assert cancelled >= 1
        header = await store.get_into(key, buf)
        assert header is not None and buf == blob[header.header_len :]
        assert await store.get(key) == blob
    finally:
        await store.close()

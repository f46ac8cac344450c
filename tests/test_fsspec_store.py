"""The generic fsspec store, on the two fsspec filesystems that run here without a service.

`fsspec+memory://` stands in for object stores (create-only publishing through
`pipe_file(mode="create")`), `fsspec+file://` for filesystems published by rename (sftp,
smb, ...). Cloud protocols (gcs, az) need their packages and accounts and are not run.
"""

from __future__ import annotations

import secrets

import fsspec
import pytest

from storage import ConfigError, StoreUnavailable, open_store
from storage.fsspec_store import FsspecStore
from tests.store_helpers import make_chunks


@pytest.fixture(params=["memory", "file"])
async def store(request, tmp_path):
    if request.param == "memory":
        s = open_store(f"fsspec+memory://kv-{secrets.token_hex(6)}")
    else:
        s = open_store(f"fsspec+file://{tmp_path}/kv?auto_mkdir=true")
    yield s
    await s.close()


async def test_put_is_create_only_and_get_verifies(store, ns):
    (key, _, blob), (absent, _, _) = make_chunks(ns, 2)
    assert await store.put(key, blob) is True
    assert await store.put(key, blob) is False
    assert await store.get(key) == blob
    assert await store.get(absent) is None
    out = bytearray(2000)
    header = await store.get_into(key, out)
    assert header is not None and bytes(out[: header.payload_len]) == blob[header.header_len :]
    stats = store.stats()
    assert (stats["puts"], stats["put_skipped"], stats["backend"]) == (1, 1, "fsspec")


async def test_publishing_mode_follows_the_filesystem(store):
    expected = "create" if store.stats()["protocol"] == "memory" else "rename"
    assert store.publish == expected


async def test_corrupt_file_is_a_miss_and_is_removed(store, ns):
    (key, _, blob), = make_chunks(ns, 1)
    damaged = bytearray(blob)
    damaged[-1] ^= 0x55
    store.fs.makedirs(store.root + "/" + key.split("/")[0], exist_ok=True)
    store.fs.pipe_file(store._path(key), bytes(damaged))
    assert await store.get(key) is None
    assert store.stats()["corrupt"] == 1
    assert not store.fs.exists(store._path(key))


async def test_prefix_len_listing_delete_and_tenants(store, ns):
    chunks = make_chunks(ns, 4)
    for i in (0, 1, 3):
        await store.put(chunks[i][0], chunks[i][2])
    keys = [k for k, _, _ in chunks]
    assert await store.prefix_len(keys) == 2
    assert await store.exists(keys) == [True, True, False, True]
    tenant = store.scoped("acme")
    await tenant.put(chunks[2][0], chunks[2][2])
    assert {k async for k in store.list_keys()} == {keys[0], keys[1], keys[3]}
    assert [k async for k in tenant.list_keys()] == [keys[2]]
    assert await store.get(keys[2]) is None
    assert await store.delete(keys[0]) is True
    assert await store.delete(keys[0]) is False


async def test_rename_publishing_leaves_no_temp_files(tmp_path, ns):
    store = open_store(f"fsspec+file://{tmp_path}/kv")
    for key, _, blob in make_chunks(ns, 3):
        await store.put(key, blob)
    leftovers = [p for p in fsspec.filesystem("file").find(str(tmp_path)) if ".tmp." in p]
    assert leftovers == []


async def test_a_failing_filesystem_is_a_miss_on_read_and_an_error_on_write(tmp_path, ns):
    """A file where the root directory should be: every operation fails underneath."""
    (tmp_path / "blocked").write_bytes(b"")
    store = open_store(f"fsspec+file://{tmp_path}/blocked/kv")
    (key, _, blob), = make_chunks(ns, 1)
    with pytest.raises(StoreUnavailable):
        await store.put(key, blob)
    assert await store.get(key) is None
    assert await store.exists([key]) == [False]


@pytest.mark.parametrize("url, complaint", [
    ("fsspec+nosuchfs://x", "nosuchfs"),
    ("fsspec+memory://x?publish=sometimes", "publish"),
])
def test_bad_urls_fail_at_open(url, complaint):
    with pytest.raises(ConfigError, match=complaint):
        open_store(url)


def test_storage_options_reach_the_filesystem(tmp_path):
    store = open_store(f"fsspec+file://{tmp_path}/kv?auto_mkdir=false&publish=rename")
    assert isinstance(store, FsspecStore)
    assert store.fs.auto_mkdir is False

"""file:// keeps to its own root: only names of its layout are listed, counted or deleted,
no symlink is followed, files are private to the store's user unless `mode=` says
otherwise, and tmp files of writers that are gone are reclaimed at open."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hashing import Namespace
from storage import ConfigError, StoreUnavailable, open_store
from storage.file import QUARANTINE, FileStore, _chunk_path
from tests.store_helpers import make_chunks

OLD = time.time() - 10 * 24 * 3600


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def tmp_name(key: str, host: str, pid: int) -> str:
    return f".{key.split('/')[1]}.kv.tmp.{host}.{pid}.ab12cd34"


def old_file(path: Path, data: bytes = b"partial upload") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.utime(path, (OLD, OLD))
    return path


def far_chunk(outside: Path, salt: str) -> tuple[Path, Path, bytes]:
    """A chunk and an old tmp file of another namespace under `outside`, in the layout."""
    ns = Namespace(model="far", dtype="d", layout="l", chunk_tokens=4, salt=salt)
    (key, _, blob), = make_chunks(ns, 1)
    chunk = old_file(_chunk_path(outside, key), blob)
    return chunk, old_file(chunk.parent / tmp_name(key, "gone-host", 1)), blob


async def test_the_scan_follows_no_symlink_and_deletes_nothing_outside_the_root(tmp_path, ns):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (key, _, blob), = make_chunks(ns, 1)
    store = FileStore(root)
    await store.put(key, blob)
    # A namespace directory that is a symlink out of the root ...
    chunk1, tmp1, blob1 = far_chunk(outside, "1")
    ns1 = chunk1.parent.parent.parent
    os.symlink(ns1, root / ns1.name)
    # ... and a fan-out directory that is one, below real ones.
    chunk2, tmp2, blob2 = far_chunk(outside, "2")
    (root / chunk2.parent.parent.parent.name / chunk2.parent.parent.name).mkdir(parents=True)
    os.symlink(chunk2.parent, root / chunk2.relative_to(outside).parent)

    reopened = FileStore(root, tmp_grace_s=0)
    assert tmp1.exists() and tmp2.exists()
    assert [k async for k in reopened.list_keys()] == [key]
    assert reopened.stats()["used_bytes"] == len(blob)
    assert (await reopened.gc(0))["evicted"] == 1
    assert tmp1.exists() and tmp2.exists()
    assert chunk1.read_bytes() == blob1 and chunk2.read_bytes() == blob2
    assert not _chunk_path(root, key).exists()


async def test_the_hot_path_neither_reads_writes_nor_deletes_through_a_symlinked_directory(
        tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    far = Namespace(model="far", dtype="d", layout="l", chunk_tokens=4, salt="hot")
    (key, _, blob), (new_key, _, new_blob) = make_chunks(far, 2)
    chunk = old_file(_chunk_path(outside, key), blob)
    store = FileStore(root, capacity=2 * len(blob))
    os.symlink(outside / key[:16], root / key[:16])
    assert await store.get(key) is None
    assert await store.get_into(key, bytearray(len(blob))) is None
    assert await store.exists([key]) == [True]  # presence is a hint; the read decides
    with pytest.raises(StoreUnavailable):
        await store.put(new_key, new_blob)
    assert await store.delete(key) is False
    assert chunk.read_bytes() == blob
    assert not _chunk_path(outside, new_key).exists()
    assert store.stats()["used_bytes"] == 0


async def test_files_that_are_not_chunks_of_the_layout_are_neither_listed_counted_nor_deleted(
        tmp_path, ns):
    (key, _, blob), (other, _, _) = make_chunks(ns, 2)
    store = FileStore(tmp_path)
    await store.put(key, blob)
    leaf = _chunk_path(tmp_path, key).parent
    digest = key.split("/")[1]
    foreign = [
        leaf / "README.kv",
        leaf / "notes.txt",
        leaf / f"{digest.upper()}.kv",  # upper-case hex is not a key
        leaf / f"{other.split('/')[1]}.kv",  # a digest that belongs in another fan-out
        leaf.parent / f"{digest}.kv",  # one level too high
        tmp_path / "scratch" / "ab" / "cd" / f"{digest}.kv",  # not a namespace directory
        leaf / f".{digest}.kv.old",
        leaf / f".notes.kv.tmp.{socket.gethostname()}.1.aa",
    ]
    for path in foreign:
        old_file(path)
    fifo = leaf / f"{digest[:4]}{'0' * 28}.kv"
    os.mkfifo(fifo)

    reopened = FileStore(tmp_path, tmp_grace_s=0)
    assert [k async for k in reopened.list_keys()] == [key]
    assert reopened.stats()["used_bytes"] == len(blob)
    await reopened.gc(0)
    assert all(p.exists() for p in foreign) and stat.S_ISFIFO(os.lstat(fifo).st_mode)


async def test_a_symlink_planted_as_a_chunk_is_never_read(tmp_path, ns):
    root = tmp_path / "root"
    (key, _, blob), = make_chunks(ns, 1)
    store = FileStore(root)
    await store.put(key, blob)
    path = _chunk_path(root, key)
    target = tmp_path / "elsewhere.kv"
    target.write_bytes(blob)
    path.unlink()
    os.symlink(target, path)
    assert await store.get(key) is None
    assert await store.get_into(key, bytearray(len(blob))) is None
    assert target.read_bytes() == blob  # the file the link named is left alone
    assert not os.path.lexists(path)  # the link itself is quarantined


@pytest.mark.parametrize("verify", ["changed", "header"])
async def test_a_sparse_file_claiming_a_terabyte_at_a_chunks_path_is_a_miss_left_unread(
        tmp_path, ns, verify):
    """A file over `max_chunk` (1 GiB by default) is never read into memory (a MemoryError
    into the caller before, or gigabytes read where the host has them): a miss for every
    read, the file left in place, the store's other chunks unaffected."""
    root = tmp_path / "root"
    (key, _, blob), (other, _, other_blob) = make_chunks(ns, 2)
    store = FileStore(root, verify=verify)
    await store.put(key, blob)
    await store.put(other, other_blob)
    path = _chunk_path(root, key)
    os.truncate(path, 1 << 40)  # the chunk's own header, then a terabyte of holes
    assert await store.get(key) is None
    assert await store.get_into(key, bytearray(len(blob))) is None
    assert await store.get_into_many([key], [bytearray(len(blob) - 4096)]) == [None]
    assert store.counters["errors"] >= 2 and store.counters["corrupt"] == 0
    assert os.path.getsize(path) == 1 << 40
    assert await store.get(other) == other_blob


async def test_max_chunk_bounds_the_files_a_read_accepts(tmp_path, ns):
    root = tmp_path / "root"
    (key, _, blob), = make_chunks(ns, 1, payload_size=2 << 20)
    await FileStore(root).put(key, blob)
    small = open_store(f"file://{root}?max_chunk=1MiB")
    assert await small.get(key) is None
    assert os.path.exists(_chunk_path(root, key))
    assert await open_store(f"file://{root}").get(key) == blob
    with pytest.raises(ConfigError, match="max_chunk"):
        open_store(f"file://{root}?max_chunk=1KiB")


async def test_quarantine_never_moves_a_chunk_through_a_symlink(tmp_path, ns):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    (key, _, blob), = make_chunks(ns, 1)
    store = FileStore(root)
    await store.put(key, blob)
    os.symlink(outside, root / QUARANTINE)
    path = _chunk_path(root, key)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(data)
    assert await store.get(key) is None
    assert list(outside.iterdir()) == []
    assert not path.exists()  # removed in place instead


def test_a_tenant_directory_that_is_a_symlink_is_refused(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    store = FileStore(root)
    os.symlink(outside, root / "tenants")
    with pytest.raises(ConfigError, match="symlink"):
        store.scoped("team-a")
    assert list(outside.iterdir()) == []


async def test_files_and_directories_are_private_by_default(tmp_path, ns):
    root = tmp_path / "root"
    (key, _, blob), = make_chunks(ns, 1)
    with umask(0):  # the modes come from the store, not from a permissive umask
        store = FileStore(root)
        await store.put(key, blob)
        tenant = store.scoped("team-a")
        await tenant.put(key, blob)
        corrupt = _chunk_path(root, key)
        corrupt.write_bytes(b"garbage")
        assert await store.get(key) is None  # quarantined
    path = _chunk_path(tenant.root, key)
    dirs = [root, root / key[:16], path.parent.parent, path.parent, root / "tenants",
            tenant.root, root / QUARANTINE]
    assert {mode_of(d) for d in dirs} == {0o700}
    assert mode_of(path) == 0o600
    assert [mode_of(p) for p in (root / QUARANTINE).iterdir()] == [0o600]


async def test_mode_option_sets_the_mode_of_files_and_directories(tmp_path, ns):
    root = tmp_path / "root"
    (key, _, blob), = make_chunks(ns, 1)
    with umask(0):
        store = open_store(f"file://{root}?mode=0640")
        await store.put(key, blob)
    path = _chunk_path(root, key)
    assert mode_of(path) == 0o640
    assert {mode_of(d) for d in (root, path.parent, path.parent.parent)} == {0o750}


@pytest.mark.parametrize("bad", ["0755", "0400", "0200", "rw-r-----", "01640", "0o1000", "9"])
def test_a_bad_mode_fails_at_open_with_one_line_naming_it(tmp_path, bad):
    with pytest.raises(ConfigError) as info:
        open_store(f"file://{tmp_path}?mode={bad}")
    message = str(info.value)
    assert f"mode={bad!r}" in message and "octal file mode" in message and "\n" not in message


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


async def test_tmp_files_of_gone_writers_on_this_host_are_reclaimed_at_once(tmp_path, ns):
    (key, _, blob), = make_chunks(ns, 1)
    store = FileStore(tmp_path)
    await store.put(key, blob)
    leaf = _chunk_path(tmp_path, key).parent
    host = socket.gethostname()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = leaf / tmp_name(key, host, dead_pid())
        alive = leaf / tmp_name(key, host, live.pid)
        remote = leaf / tmp_name(key, "another-host", 4242)
        for path, size in ((dead, 1000), (alive, 3000), (remote, 5000)):
            path.write_bytes(bytes(size))
        reopened = FileStore(tmp_path)  # tmp_grace: the default 10 minutes
        assert not dead.exists()
        assert alive.exists() and remote.exists()
        assert reopened.stats()["tmp_bytes"] == 8000
        assert reopened.stats()["used_bytes"] == len(blob) + 8000
    finally:
        live.kill()
        live.wait()
    FileStore(tmp_path)  # its writer is gone now
    assert not alive.exists() and remote.exists()


async def test_tmp_files_of_other_writers_count_against_the_capacity(tmp_path, ns):
    chunks = make_chunks(ns, 3)
    size = len(chunks[0][2])
    store = FileStore(tmp_path, capacity=3 * size)
    for k, _, b in chunks[:2]:
        await store.put(k, b)
    leaf = _chunk_path(tmp_path, chunks[0][0]).parent
    (leaf / tmp_name(chunks[0][0], "another-host", 4242)).write_bytes(bytes(size))
    reopened = FileStore(tmp_path, capacity=3 * size)
    await reopened.put(*chunks[2][::2])
    assert reopened.stats()["used_bytes"] <= 3 * size
    assert sum(await reopened.exists([k for k, _, _ in chunks])) == 2

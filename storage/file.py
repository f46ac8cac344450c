"""`file:///path?capacity=500GiB` — chunks as files on a local disk or an NFS mount.

Layout: `<root>/<ns_id>/<d[0:2]>/<d[2:4]>/<digest>.kv`, tenants under `<root>/tenants/<t>/`.
Publish: write `.<digest>.tmp.<host>.<pid>.<rand>` in the destination directory, fsync,
then `link()` it to the final name (atomic and create-only on local filesystems and NFS:
EEXIST means another writer won, which is success) and unlink the tmp. Readers therefore
never see a partial chunk. `ENOENT`/`ESTALE` while reading (a peer evicted the file) is
a miss. A put checks every checksum of the chunk (payload and segments); a large one does
so while the fsync waits on the disk (with `capacity=`, before it writes, as its bytes are
reserved first); a chunk that fails the check is never linked and evicts nothing.

Verification (`verify=`): `changed` (default) checks the payload's xxh3 the first time
this process reads a file and again whenever its identity (inode, size, mtime, ctime)
changes; chunks are immutable, so any rewrite, truncation or byte flip through the
filesystem re-triggers the check, while page-cached re-reads of an unchanged file cost
no hashing (on 2 cores the hash would otherwise cost a third of a warm read). The
verified headers are kept in one cache per root (its tenants share it) bounded in bytes
of memory (`VerifiedHeaders`, each header charged `ChunkHeader.cost`); a file whose
header fell out is simply verified again. A verification is remembered only once the
file's ctime is `settle` old (1s): a change after that carries another ctime even where
timestamps are coarse. `always` hashes every read; `header` checks only the header (key,
tokens, length).

The root: the store touches only names of its own layout. The scan at open (and `gc`)
opens each directory O_NOFOLLOW relative to its parent and lists regular files only, so it
never follows a symlink; a name that is not a chunk or tmp file of the layout is neither
listed, counted nor deleted. Reads, writes, deletes and evictions first check that the
chunk's directories are real ones (remembered once found so), chunk files are opened
O_NOFOLLOW (a symlink planted as a chunk is quarantined unread), and `.quarantine/` is
used only while it is a real directory. It keeps the most recent rejected files up to
`QUARANTINE_MAX_BYTES` or a sixteenth of `capacity=` (the oldest go first; a larger file
is deleted at once), and its bytes count in `used_bytes` and against the capacity. Files are created with `mode=` (default 0600), directories with the same bits
plus search where it grants read (0700; 0640 -> 0750); the umask may narrow both.
Tmp files of other writers count in `used_bytes` while they exist; at open a tmp file is
reclaimed when it is older than `tmp_grace`, or at once when its name says it was written
on this host by a pid that is no longer alive.

Capacity: an in-process LRU index (key -> size) rebuilt from the directory at open,
ordered by each file's atime (hits refresh it at most once a minute), so eviction order
survives a restart and the hot path never scans. With `capacity=`, the bytes of the whole
root (its tenants' directories, tmp files and quarantine included) are counted once for
every process and tenant writing there (storage.ledger, `<root>/.usage` under flock): a
put is checked, then reserves its bytes, evicting first where the root would pass the
capacity, then writes; so the root never holds more than the capacity, whoever writes.
Eviction, for the capacity or for a full disk, takes from the scope (the root's own
chunks, or one tenant's) holding the most bytes first, its least recently used chunks;
a scope's chunks written by other processes are found by a scan of its directory once
those this process knows are gone. `kvstash gc` rescans the whole root, evicts down to a
capacity the same way and sets the count right.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import logging
import os
import secrets
import socket
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from storage.base import (
    TENANT_PATTERN,
    BlobFile,
    Store,
    check_batch,
    check_blob_header,
    check_blob_payload,
    check_key,
    check_tenant,
)
from storage.capabilities import NOT_RESIDENT
from storage.codec import (
    HEADER_SIZE,
    MAX_CHUNK,
    ChunkError,
    ChunkHeader,
    TruncatedHeader,
    decode_chunk,
    decode_header,
)
from storage.errors import ConfigError, StoreFull, StoreUnavailable
from storage.ledger import LEDGER, QUARANTINE_SCOPE, RootLedger, quarantine_scope
from storage.options import StoreURL, format_size, parse_bool, parse_mode, parse_seconds, parse_size
from storage.pagecache import PAGE_CACHE, Residency, is_local

if TYPE_CHECKING:  # the layer above, for the types of what it hands in
    from gds.chunkio import ChunkIO
    from gds.errors import ReadError

log = logging.getLogger("kvstash.storage.file")

SUFFIX = ".kv"
TMP_MARK = ".tmp."
QUARANTINE = ".quarantine"
TENANTS = "tenants"
# Below this much free space the disk counts as full for readiness (storage.base.health).
MIN_FREE_BYTES = 1 << 20
_MISS_ERRNOS = (errno.ENOENT, errno.ESTALE, errno.ENOTDIR)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_ATIME_REFRESH_S = 60.0
# `.quarantine/` keeps the most recent rejected files, for a look by hand, up to this many
# bytes (or a sixteenth of `capacity=`, where less): a reader that quarantines on every
# read of a rewritten chunk must not fill the disk with copies.
QUARANTINE_MAX_BYTES = 256 << 20
VERIFY_MODES = ("changed", "always", "header")


# Headers of verified files kept per root (its tenants' scopes share it), in bytes of
# memory as `ChunkHeader.cost` counts them; the least recently used go first.
VERIFIED_CACHE_BYTES = 32 << 20


class VerifiedHeaders:
    """Headers of chunk files whose payload checked out, by (scope root, key) with the file's
    identity, bounded in bytes: what a tenant makes this process hold is bounded whatever its
    chunks' headers parse into. Thread-safe."""

    def __init__(self, max_bytes: int = VERIFIED_CACHE_BYTES):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], tuple[tuple[int, int, int, int], ChunkHeader]] = (
            OrderedDict())

    def get(self, scope: str, key: str, identity: tuple[int, int, int, int]) -> ChunkHeader | None:
        with self._lock:
            known = self._entries.get((scope, key))
            if known is None or known[0] != identity:
                return None
            self._entries.move_to_end((scope, key))
            return known[1]

    def put(self, scope: str, key: str, identity: tuple[int, int, int, int],
            header: ChunkHeader) -> None:
        cost = header.cost
        with self._lock:
            self._drop((scope, key))
            if cost > self.max_bytes // 16:
                return  # one header may take at most a sixteenth of the cache
            self._entries[(scope, key)] = (identity, header)
            self.bytes += cost
            while self.bytes > self.max_bytes:
                _, (_, old) = self._entries.popitem(last=False)
                self.bytes -= old.cost

    def pop(self, scope: str, key: str) -> None:
        with self._lock:
            self._drop((scope, key))

    def _drop(self, entry: tuple[str, str]) -> None:
        known = self._entries.pop(entry, None)
        if known is not None:
            self.bytes -= known[1].cost

    def __len__(self) -> int:
        return len(self._entries)


# A verified identity is only trusted once its ctime is this old (`settle_s`): any later
# change then carries a different ctime even on filesystems with coarse (jiffy) timestamps.
_SETTLED_S = 1.0


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _chunk_path(root: Path, key: str) -> Path:
    return Path(_chunk_file(str(root), key))


def _chunk_file(root: str, key: str) -> str:
    """`_chunk_path` as a string: a Path built per read cost 60 us of a 0.2 ms page-cached
    chunk read."""
    ns_id, digest = key.split("/")
    return f"{root}/{ns_id}/{digest[:2]}/{digest[2:4]}/{digest}{SUFFIX}"


_HEX = frozenset("0123456789abcdef")


def _is_hex(text: str, n: int) -> bool:
    return len(text) == n and _HEX.issuperset(text)


def _tmp_writer(name: str, fanout: str) -> tuple[str, int] | None:
    """(host, pid) of the writer of a tmp file `.<digest>.kv.tmp.<host>.<pid>.<rand>` in
    the fan-out directory of `fanout` (d[0:4]); pid -1 where it is unreadable; None for any
    name that is not a tmp file of this layout."""
    head = 1 + 32 + len(SUFFIX) + len(TMP_MARK)
    digest = name[1:33]
    if not (name.startswith(".") and _is_hex(digest, 32) and digest.startswith(fanout)
            and name[33:head] == SUFFIX + TMP_MARK):
        return None
    host_pid = name[head:].rpartition(".")[0]
    host, _, pid = host_pid.rpartition(".")
    return host, int(pid) if pid.isascii() and pid.isdigit() and len(pid) < 10 else -1


def _writer_is_gone(host: str, pid: int) -> bool:
    """True only when the writer ran on this host and no process has its pid now."""
    if host != socket.gethostname() or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)  # signal 0 only asks whether the pid exists
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it exists, as another user's process
        return False
    return False


def _leaves_root(leaf: str) -> bool | None:
    """Whether the directories of a chunk's path below the root (`leaf` is
    `<root>/<ns_id>/<d0d1>/<d2d3>`) lead out of it: True when a level exists as anything
    but a real directory (a symlink planted there: the store follows none), False when all
    three are real directories, None when a level is missing (nothing there to follow)."""
    for d in (leaf[:-6], leaf[:-3], leaf):
        try:
            if not stat.S_ISDIR(os.lstat(d).st_mode):
                return True
        except OSError:
            return None
    return False


# Keys a listing hands over per trip to a worker thread.
_LIST_BATCH = 1024


def _next_batch(items: Iterator[str], n: int) -> list[str]:
    return list(itertools.islice(items, n))


# Fan-out directories remembered as checked (~150 bytes each): a full namespace has 65,536.
_REAL_DIRS_MAX = 1 << 16
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _layout_dirs(dir_fd: int, widths: tuple[int, ...]) -> Iterator[tuple[int, list[str]]]:
    """(descriptor, names) of each directory below `dir_fd` whose path is one name of
    each hex width in `widths` (`<ns_id>/<d0d1>/<d2d3>`): real directories only, each
    opened O_NOFOLLOW relative to its parent, so a symlink swapped in midway is refused."""
    if not widths:
        yield dir_fd, []
        return
    try:
        with os.scandir(dir_fd) as it:
            names = [e.name for e in it if _is_hex(e.name, widths[0]) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for name in names:
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except OSError:
            continue
        try:
            for leaf_fd, below in _layout_dirs(fd, widths[1:]):
                yield leaf_fd, [name, *below]
        finally:
            os.close(fd)


def read_at(fd: int, size: int, offset: int = 0) -> bytes:
    """Up to `size` bytes of `fd` from `offset` (fewer only where the file ends)."""
    parts = []
    while size > 0:
        part = os.pread(fd, size, offset)
        if not part:
            break
        parts.append(part)
        size -= len(part)
        offset += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _read_header(fd: int, key: str) -> ChunkHeader:
    """The header of `key`'s open chunk file, read and decoded (the usual 4 KiB first,
    then as much as a longer header says it is)."""
    try:
        return decode_header(read_at(fd, HEADER_SIZE), key)
    except TruncatedHeader as short:
        return decode_header(read_at(fd, short.header_len), key)


def read_into_at(fd: int, view: memoryview, offset: int) -> int:
    """Fill `view` from `fd` at `offset` -> the bytes read (fewer only where the file ends)."""
    return read_parts_at(fd, [view], offset)


def read_parts_at(fd: int, parts: list[memoryview], offset: int) -> int:
    """Fill `parts` in order from `fd` at `offset` (one preadv per IOV_MAX of them, more
    only after a short read) -> the bytes read (fewer only where the file ends)."""
    todo, done = list(parts), 0
    while todo:
        n = os.preadv(fd, todo[:_IOV_MAX], offset + done)
        if n == 0:
            break
        done += n
        while todo and n >= todo[0].nbytes:
            n -= todo.pop(0).nbytes
        if n:
            todo[0] = todo[0][n:]
    return done


def _write_all(fd: int, data: memoryview) -> None:
    while data.nbytes:
        n = os.write(fd, data)
        data = data[n:]


def link_publish(tmp: Path, final: Path) -> bool:
    """Publish a complete, synced `tmp` as `final`: True if this call created it.

    `link()` is atomic and create-only on local filesystems and NFS (EEXIST: another writer
    won, which is success). Filesystems without hard links fall back to rename: still
    atomic, merely not create-only; a lost race overwrites identical bytes.
    """
    try:
        os.link(tmp, final)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        existed = final.exists()
        os.rename(tmp, final)
        return not existed


# fsync waits on the disk, not the CPU: a large put hashes its payload meanwhile. Below
# OVERLAP_MIN the hash is shorter than the hand-off to another thread (in paired runs of
# `kvstash bench store` here, 4 MiB puts ran faster without the overlap, 16 MiB with it).
_SYNCERS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvstash-fsync")
OVERLAP_MIN = 8 << 20


def _sync_while(fd: int, work: Callable[[], None]) -> None:
    """fsync `fd` on a helper thread while `work()` runs here; both finish before return."""
    synced = _SYNCERS.submit(os.fsync, fd)
    try:
        work()
    finally:
        futures_wait([synced])
    synced.result()


def _make_fanout(leaf: Path, dir_mode: int) -> None:
    """Create `<root>/<ns_id>/<d0d1>/<d2d3>` down to `leaf` (the root too, if it was
    removed meanwhile), each level with `dir_mode` (os.makedirs would give the upper
    levels the default mode)."""
    for d in (leaf.parent.parent.parent, leaf.parent.parent, leaf.parent, leaf):
        try:
            os.mkdir(d, dir_mode)
        except FileExistsError:
            pass


def _atomic_publish(final: Path, data: memoryview, fsync: bool,
                    check: Callable[[], None] | None = None,
                    mode: int = 0o600, dir_mode: int = 0o700) -> bool:
    """Create `final` with `data` unless it exists; True if this call created it.

    Once the bytes are written, `check()` runs while the file syncs; if it raises, nothing
    is published. When `final` exists, only `check()` runs. The file gets `mode`, missing
    fan-out directories `dir_mode` (the umask may narrow both).
    """
    if final.exists():
        if check is not None:
            check()
        return False

    def before_link() -> None:
        if check is not None:
            check()

    tmp = final.parent / f".{final.name}{TMP_MARK}{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        fd = os.open(tmp, flags, mode)
    except FileNotFoundError:  # the first chunk of its fan-out directory
        _make_fanout(final.parent, dir_mode)
        fd = os.open(tmp, flags, mode)
    try:
        try:
            _write_all(fd, data)
            if fsync and data.nbytes >= OVERLAP_MIN:
                _sync_while(fd, before_link)
            else:
                before_link()
                if fsync:
                    os.fsync(fd)
        finally:
            os.close(fd)
        return link_publish(tmp, final)
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def _scan_dir(root: Path | str, reclaim: bool, tmp_grace_s: float,
          ) -> tuple[list[tuple[float, str, int]], int]:
    """(last use, key, size) of every chunk file of this store's layout, and the bytes
    of the other writers' tmp files there. Symlinks are never followed (directories
    are opened O_NOFOLLOW, relative to their parent's descriptor) and any name that is
    not a chunk or a tmp file of the layout is neither listed, counted nor touched.
    With `reclaim`, tmp files whose writer is gone are deleted: past `tmp_grace`, or at
    once when the writer ran on this host and its pid is no longer alive."""
    found: list[tuple[float, str, int]] = []
    tmp_bytes = 0
    now = time.time()
    mine = (socket.gethostname(), os.getpid())
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return found, 0
    try:
        for leaf_fd, (ns_id, d1, d2) in _layout_dirs(root_fd, (16, 2, 2)):
            fanout = d1 + d2
            try:
                with os.scandir(leaf_fd) as it:
                    entries = list(it)
            except OSError:
                continue
            for e in entries:
                name = e.name
                try:
                    if not e.is_file(follow_symlinks=False):
                        continue
                    if name.endswith(SUFFIX) and _is_hex(name[:-3], 32) and name.startswith(fanout):
                        st = e.stat(follow_symlinks=False)
                        found.append((max(st.st_atime, st.st_mtime), f"{ns_id}/{name[:-3]}", st.st_size))
                        continue
                    writer = _tmp_writer(name, fanout)
                    if writer is None or writer == mine:
                        continue  # not ours to judge, or in flight in this process
                    st = e.stat(follow_symlinks=False)
                    if reclaim and (now - st.st_mtime > tmp_grace_s or _writer_is_gone(*writer)):
                        os.unlink(name, dir_fd=leaf_fd)
                    else:
                        tmp_bytes += st.st_size
                except OSError:
                    continue
    finally:
        os.close(root_fd)
    return found, tmp_bytes


def _scope_dirs(top: Path) -> Iterator[tuple[str, Path]]:
    """(scope, directory) of the root itself ("") and of every tenant directory under it
    (real directories with a tenant's name only)."""
    yield "", top
    try:
        if not stat.S_ISDIR(os.lstat(top / TENANTS).st_mode):
            return  # a symlink: the store follows none
        with os.scandir(top / TENANTS) as it:
            names = [e.name for e in it if TENANT_PATTERN.fullmatch(e.name)
                     and e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for name in sorted(names):
        yield name, top / TENANTS / name


def _quarantine_bytes(scope_root: Path) -> int:
    try:
        fd = os.open(scope_root / QUARANTINE, _DIR_FLAGS)
    except OSError:
        return 0
    try:
        with os.scandir(fd) as it:
            return sum(e.stat(follow_symlinks=False).st_size for e in it
                       if e.is_file(follow_symlinks=False))
    except OSError:
        return 0
    finally:
        os.close(fd)


def scan_root(top: Path, tmp_grace_s: float = 600.0) -> dict[str, dict[str, int]]:
    """Per scope of the root `top` ("" and each tenant): its chunk files (`chunks`, and
    their bytes with the other writers' tmp files, `bytes`) and `.quarantine/`'s bytes."""
    out = {}
    for scope, path in _scope_dirs(top):
        found, tmp_bytes = _scan_dir(path, False, tmp_grace_s)
        out[scope] = {"chunks": len(found), "bytes": sum(size for _, _, size in found) + tmp_bytes,
                      "quarantine_bytes": _quarantine_bytes(path)}
    return out


class FileStore(Store):
    def __init__(
        self,
        root: str | os.PathLike,
        capacity: int | None = None,
        *,
        fsync: bool = True,
        verify: str = "changed",
        tmp_grace_s: float = 600.0,
        mode: int = 0o600,
        url: str | None = None,
        verified: VerifiedHeaders | None = None,
        scope: str = "",
        family: dict[str, FileStore] | None = None,
        ledger: RootLedger | None = None,
        residency: Residency | None = None,
        settle_s: float = _SETTLED_S,
        max_chunk: int = MAX_CHUNK,
    ):
        """`max_chunk` (`max_chunk=` in the URL): the largest file a read accepts; a larger
        one at a chunk's path (planted there, or a sparse file claiming terabytes) is a
        miss left in place, never read into memory. `residency`: the page-cache oracle
        every read that plans by residency asks (see storage.pagecache; None: the
        kernel's, PAGE_CACHE; tests declare chunks resident or not through it).
        `settle_s` (`settle=` in the URL): how old a file's ctime must be before its
        verification is remembered (see `note_verified`); 0 remembers it at once, for a
        filesystem whose timestamps are fine-grained, or a test whose files change only
        where their mtime shows it."""
        super().__init__()
        self.root = Path(root)
        # The root's own chunks are scope "", a tenant's `tenants/<scope>/`; `family` holds
        # the stores this process opened over one root, by scope (eviction on a full disk
        # or past the capacity picks among them).
        self.scope = scope
        self._top = self.root.parent.parent if scope else self.root
        self._family = family if family is not None else {}
        self._family[scope] = self
        self._root = str(self.root)
        self.mode = mode
        # Directories: the file mode plus search (x) wherever it grants read (0640 -> 0750).
        self.dir_mode = mode | (mode & 0o444) >> 2
        self.capacity = capacity
        self.fsync = fsync
        if verify not in VERIFY_MODES:
            raise ConfigError(f"verify={verify!r}: expected one of {', '.join(VERIFY_MODES)}")
        self.verify = verify
        # (file identity, its verified header) by key for files whose payload checked out
        self._verified = verified if verified is not None else VerifiedHeaders()
        self.tmp_grace_s = tmp_grace_s
        self.quarantine_max = (QUARANTINE_MAX_BYTES if capacity is None
                               else min(QUARANTINE_MAX_BYTES, capacity // 16))
        self._quarantine_bytes = 0  # what `.quarantine/` holds, trimmed to quarantine_max
        self._quarantined = 0  # files there
        self.residency = PAGE_CACHE if residency is None else residency
        self.settle_s = settle_s
        if max_chunk < HEADER_SIZE:
            raise ConfigError(f"{url or root}: max_chunk must be at least {HEADER_SIZE} bytes")
        self.max_chunk = max_chunk
        self.url = url or f"file://{self.root}"
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self._tmp_bytes = 0  # tmp files of other writers, found by the last scan
        self._real_dirs: set[str] = set()  # fan-out directories checked to be no symlink
        self._chunk_io: ChunkIO | None = None  # see enable_direct_reads
        self._owns_chunk_io = False
        self._open_root()
        # Whether reads of cached chunks may run on an engine's thread (read_resident_into):
        # on a network filesystem even `open` may wait on a server.
        self._local = is_local(os.stat(self.root).st_dev)
        # With a capacity, every process and tenant writing under the root shares one count
        # of its bytes (storage.ledger), counted anew from the whole root by its opener.
        self._ledger = ledger
        self._reserved = 0  # bytes this store reserved in the ledger for puts not yet landed
        self._owns_ledger = capacity is not None and ledger is None
        if self._owns_ledger:
            try:
                self._ledger = RootLedger(self.root, mode)
            except OSError as exc:
                raise ConfigError(f"store root {self.root}: cannot open its usage file: "
                                  f"{exc.strerror}") from exc
        self._rebuild_index()
        self._trim_quarantine()
        if self._ledger is not None and ledger is None:
            self._recount()

    @property
    def capacity_shared(self) -> bool:
        """Whether this store enforces its capacity over the whole root itself, across
        every process and tenant scope (storage.tenancy then leaves it to the store)."""
        return self._ledger is not None and self.capacity is not None

    @classmethod
    def from_url(cls, u: StoreURL) -> FileStore:
        if u.netloc not in ("", "localhost"):
            raise ConfigError(f"{u.redacted()}: file:// URLs take an absolute path (file:///path)")
        if not u.path:
            raise ConfigError(f"{u.redacted()}: missing directory path")
        store = cls(
            u.path,
            capacity=u.take("capacity", parse_size),
            fsync=u.take("fsync", parse_bool, True),
            verify=u.take("verify", str, "changed"),
            tmp_grace_s=u.take("tmp_grace", parse_seconds, 600.0),
            mode=u.take("mode", parse_mode, 0o600),
            settle_s=u.take("settle", parse_seconds, _SETTLED_S),
            max_chunk=u.take("max_chunk", parse_size, MAX_CHUNK),
            url=u.url,
        )
        u.finish()
        return store

    def _open_root(self) -> None:
        try:
            self.root.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.mkdir(self.root, self.dir_mode)
            except FileExistsError:
                pass
            probe = self.root / f".probe.{os.getpid()}.{secrets.token_hex(4)}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"store root {self.root} is not a writable directory: {exc.strerror}") from exc

    def _scan(self, reclaim: bool) -> tuple[list[tuple[float, str, int]], int]:
        return _scan_dir(self.root, reclaim, self.tmp_grace_s)

    def _rebuild_index(self) -> None:
        found, tmp_bytes = self._scan(reclaim=True)
        found.sort()
        with self._lock:
            self._index = OrderedDict((k, size) for _, k, size in found)
            self._used = sum(self._index.values())
            self._tmp_bytes = tmp_bytes

    # -- index ---------------------------------------------------------------------------

    def _note(self, key: str, size: int) -> None:
        with self._lock:
            old = self._index.pop(key, None)
            if old is not None:
                self._used -= old
            self._index[key] = size
            self._used += size

    def _forget(self, key: str) -> bool:
        """Drop `key` from the index; whether it was there (then "removed" is reported)."""
        self._verified.pop(self._root, key)
        with self._lock:
            old = self._index.pop(key, None)
            if old is not None:
                self._used -= old
        if old is not None:  # it was visible here: deleted, quarantined or found gone
            self._changed("removed", key)
        return old is not None

    # -- the root's shared count (storage.ledger) ------------------------------------------

    def _recount(self) -> None:
        """Set the ledger to what a scan of the whole root finds, plus what this process's
        stores reserved for puts still under way (theirs are not files yet)."""
        assert self._ledger is not None
        with self._ledger.locked() as usage:
            usage.clear()
            for scope, found in scan_root(self._top, self.tmp_grace_s).items():
                usage[scope] = found["bytes"]
                usage[quarantine_scope(scope)] = found["quarantine_bytes"]
            for scope, member in list(self._family.items()):
                usage[scope] = usage.get(scope, 0) + member._reserved

    def _ledger_add(self, scope: str, nbytes: int) -> None:
        if self._ledger is not None and nbytes:
            with self._ledger.locked() as usage:
                usage[scope] = usage.get(scope, 0) + nbytes

    def _reserve(self, size: int) -> None:
        """Count `size` more bytes for this scope in the root's ledger, first evicting from
        the largest scopes of the root what the capacity needs, all under its lock."""
        assert self._ledger is not None and self.capacity is not None
        with self._ledger.locked() as usage:
            if self._ledger.fresh:  # empty or torn: count the root anew
                self._recount()
            over = sum(usage.values()) + size - self.capacity
            if over > 0:
                self._free_across(over)
            usage[self.scope] = usage.get(self.scope, 0) + size
            self._reserved += size

    def _settle(self, size: int, landed: bool) -> None:
        """A reserved put is over: its bytes stay counted if its file landed."""
        assert self._ledger is not None
        if landed:  # counted already: nothing to write
            with self._lock:
                self._reserved -= size
            return
        with self._ledger.locked() as usage, self._lock:
            self._reserved -= size
            usage[self.scope] = usage.get(self.scope, 0) - size

    def _scope_sizes(self) -> dict[str, int]:
        """Bytes per scope of the root: the ledger's count where there is one, else what
        this process's stores over the root know of theirs."""
        if self._ledger is not None:
            with self._ledger.locked() as usage:
                return {k: v for k, v in usage.items() if not k.endswith(QUARANTINE_SCOPE)}
        out = {}
        for scope, member in list(self._family.items()):
            with member._lock:
                out[scope] = member._used
        return out

    def _member(self, scope: str) -> FileStore | None:
        """This process's store of `scope` under the root, opened now if it was not."""
        member = self._family.get(scope)
        if member is None and scope:
            try:
                member = self._family[""].scoped(scope) if "" in self._family else None
            except (ConfigError, ValueError):
                return None
        return member

    def _free_across(self, nbytes: int) -> int:
        """Evict at least `nbytes` from the root, from the scope holding the most bytes
        first (its least recently used chunks), then the next; the bytes freed."""
        freed, spent = 0, set()
        while freed < nbytes:
            sizes = [(held, scope) for scope, held in self._scope_sizes().items()
                     if held > 0 and scope not in spent]
            if not sizes:
                break
            _, scope = max(sizes)
            member = self._member(scope)
            got = 0 if member is None else member._evict_bytes(nbytes - freed)
            if got < nbytes - freed:
                spent.add(scope)
            freed += got
        return freed

    def _evict_bytes(self, nbytes: int) -> int:
        """Evict this scope's least recently used chunks until `nbytes` are freed or none is
        left: first those this process knows, then, after a scan of its directory, those
        other processes wrote. The bytes freed (only unlinks made here count). Where the
        scope is then empty, its ledger count is set to what is left on disk."""
        freed = 0
        for rescan in (False, True):
            if rescan:
                self._rebuild_index()
            with self._lock:
                target = max(self._used - (nbytes - freed), 0)
            freed += self._evict_to(target, count_extra=False)
            if freed >= nbytes:
                return freed
        if self._ledger is not None:
            with self._ledger.locked() as usage, self._lock:
                usage[self.scope] = self._used + self._tmp_bytes + self._reserved
        return freed

    def _quarantine(self, key: str, path: Path | str, why: str, recheck: bool = True) -> None:
        """Move a chunk file that failed a check out of the store. With `recheck`, the file is
        first read again whole into memory of this store's own and checked there: a reader
        that reads into someone else's memory (an engine's KV cache) can see a good file
        fail because its buffers changed under the read (two destinations that are one
        block, say); such a file is kept, and only that read was a miss."""
        path = Path(path)
        if recheck and _checks_whole(path, key, self.max_chunk):
            self.counters["rechecked"] += 1
            log.warning("%s: chunk %s failed a check (%s) in the reader's buffers but checks "
                        "read again on its own: kept", self, key, why)
            return
        self.counters["corrupt"] += 1
        self._forget(key)
        log.warning("%s: quarantined corrupt chunk %s: %s", self, key, why)
        try:
            qdir = self.root / QUARANTINE
            try:
                os.mkdir(qdir, self.dir_mode)
            except FileExistsError as exc:
                if not stat.S_ISDIR(os.lstat(qdir).st_mode):  # never moved through a symlink
                    raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(qdir)) from exc
            size = os.lstat(path).st_size
            if size > self.quarantine_max:
                raise OSError(errno.EFBIG, "larger than the quarantine")
            os.rename(path, qdir / f"{path.name}.{int(time.time())}.{secrets.token_hex(2)}")
            self._ledger_add(self.scope, -size)
            self._ledger_add(quarantine_scope(self.scope), size)
        except OSError:
            try:
                size = os.lstat(path).st_size
                path.unlink()
                self._ledger_add(self.scope, -size)
            except OSError:
                pass
        self._trim_quarantine()

    def _trim_quarantine(self) -> None:
        """Remove the oldest files of `.quarantine/` (a real directory only) until it holds
        at most `quarantine_max` bytes; count what stays."""
        try:
            fd = os.open(self.root / QUARANTINE, _DIR_FLAGS)
        except OSError:
            with self._lock:
                self._quarantine_bytes = self._quarantined = 0
            return
        try:
            files = []
            with os.scandir(fd) as it:
                for e in it:
                    try:
                        if e.is_file(follow_symlinks=False):
                            st = e.stat(follow_symlinks=False)
                            files.append((st.st_ctime_ns, e.name, st.st_size))
                    except OSError:
                        continue
            files.sort()
            held = sum(size for _, _, size in files)
            while files and held > self.quarantine_max:
                _, name, size = files.pop(0)
                try:
                    os.unlink(name, dir_fd=fd)
                except FileNotFoundError:
                    pass
                except OSError:
                    continue
                held -= size
        finally:
            os.close(fd)
        with self._lock:
            self._quarantine_bytes, self._quarantined = held, len(files)
        if self._ledger is not None:
            with self._ledger.locked() as usage:
                usage[quarantine_scope(self.scope)] = held

    # -- blocking halves, run in threads -------------------------------------------------

    def _put_sync(self, key: str, blob: memoryview, check: Callable[[], None] | None = None) -> bool:
        """Publish `blob` as `key`. `check()` (the payload hash) runs while the file syncs
        and before anything is evicted for it: a rejected chunk neither lands nor evicts."""
        final = _chunk_path(self.root, key)
        if self._leads_out(final.parent):
            raise StoreUnavailable(f"{self}: {final.parent} leads out of the root through a symlink; "
                                   f"{key} not written")
        if self.capacity is not None and blob.nbytes > self.capacity:
            raise StoreFull(f"{self}: chunk of {blob.nbytes} bytes exceeds capacity {self.capacity}")

        reserved = [False]
        if self.capacity_shared:
            # The root's bytes never pass the capacity, tmp files included: the chunk is
            # checked, then its bytes reserved (evicting what they need), then written.
            if final.exists():
                if check is not None:
                    check()
                return False
            if check is not None:
                check()
                check = None

        def settle(landed: bool) -> None:
            if reserved[0]:
                reserved[0] = False
                self._settle(blob.nbytes, landed)

        for attempt in (0, 1):
            try:
                if self.capacity_shared:
                    self._reserve(blob.nbytes)
                    reserved[0] = True
                wrote = _atomic_publish(final, blob, self.fsync, check, self.mode, self.dir_mode)
                settle(wrote)
                break
            except OSError as exc:
                settle(False)
                if exc.errno in _FULL_ERRNOS:
                    if attempt == 0 and self._free_across(2 * blob.nbytes):
                        # The disk is fuller than the counts know (other writers, other
                        # files): the largest scope of the root frees two chunks' worth
                        # (this one's only where it holds the most), and the put is tried
                        # once more.
                        continue
                    log.warning("%s: disk full, put of %s dropped: %s", self, key, exc.strerror)
                    raise StoreFull(f"{self}: no space for {key}: {exc.strerror}") from exc
                raise StoreUnavailable(f"{self}: put {key} failed: {exc.strerror}") from exc
            except BaseException:
                settle(False)
                raise
        if wrote:
            self._note(key, blob.nbytes)
        return wrote

    def _open_for_read(self, key: str) -> tuple[int, str] | None:
        path = _chunk_file(self._root, key)
        parent = os.path.dirname(path)
        if self._leads_out(parent):
            self.counters["errors"] += 1
            log.warning("%s: %s leads out of the root through a symlink; not read", self, parent)
            self._forget(key)
            return None
        try:
            return os.open(path, os.O_RDONLY | os.O_NOFOLLOW), path
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink planted as a chunk: never read it
                self._quarantine(key, path, "a symlink, not a chunk file", recheck=False)
                return None
            if exc.errno not in _MISS_ERRNOS:
                self.counters["errors"] += 1
                log.warning("%s: open %s failed: %s", self, key, exc.strerror)
            self._forget(key)
            return None

    def _needs_payload_check(self, key: str, st: os.stat_result) -> bool:
        if self.verify == "header":
            return False
        return self.verify == "always" or self.known_header(key, st) is None

    # Also the interface for readers that open chunk files themselves (gds.ChunkIO), so
    # they share this store's `verify=` policy: see ChunkIO.submit_chunk(trust=...).
    def known_header(self, key: str, st: os.stat_result) -> ChunkHeader | None:
        """Under `verify=changed`: the header of `key` if this very file (same inode, size,
        mtime, ctime) was verified whole before, so a reader may skip the header and the
        payload hash; else None."""
        if self.verify != "changed":
            return None
        return self._verified.get(self._root, key, _identity(st))

    def note_verified(self, key: str, st: os.stat_result, header: ChunkHeader) -> None:
        """A reader checked this file's header and payload hash against `key` (trusted only
        once the file's ctime is `settle_s` old)."""
        if time.time() - st.st_ctime > self.settle_s:
            self._verified.put(self._root, key, _identity(st), header)

    def _touch(self, key: str, path: Path | str, st: os.stat_result) -> None:
        self._note(key, st.st_size)
        now = time.time()
        if now - st.st_atime > _ATIME_REFRESH_S:
            try:
                os.utime(path, (now, st.st_mtime))
            except OSError:
                pass

    def _get_sync(self, key: str, out: memoryview | None = None, as_file: bool = False) -> Any:
        """The verified blob: a new bytes object, or a view of `out` if given and big enough;
        with `as_file`, the open file instead where its bytes need no reading to be vouched
        for (a file verified before and unchanged since, or any file under verify=header
        whose header checks)."""
        opened = self._open_for_read(key)
        if opened is None:
            return None
        fd, path = opened
        try:
            st = os.fstat(fd)
            if self._oversize(key, st):
                return None
            if as_file and self._vouch_unread(key, fd, st):
                self._touch(key, path, st)
                file, fd = BlobFile(fd, st.st_size), -1  # the caller closes it now
                return file
            blob: memoryview | bytes
            if out is not None and out.nbytes >= st.st_size:
                blob = out[: read_into_at(fd, out[: st.st_size], 0)]
            else:
                blob = read_at(fd, st.st_size)
        except OSError as exc:
            if exc.errno not in _MISS_ERRNOS:
                self.counters["errors"] += 1
            return None
        finally:
            if fd >= 0:
                os.close(fd)
        try:
            if self._needs_payload_check(key, st):
                self.note_verified(key, st, decode_chunk(blob, key).header)
            else:
                header = self.known_header(key, st) or decode_header(blob, key)
                if len(blob) != header.total_len:
                    raise ChunkError("short read")
        except ChunkError as exc:
            self._quarantine(key, path, str(exc))
            return None
        self._touch(key, path, st)
        return blob

    def _vouch_unread(self, key: str, fd: int, st: os.stat_result) -> bool:
        header = self.known_header(key, st)
        if header is None and self.verify == "header":
            try:
                header = decode_header(os.pread(fd, HEADER_SIZE, 0), key)
            except ChunkError:
                return False  # the full read that follows decides (and quarantines)
        return header is not None and header.total_len == st.st_size

    def _get_into_sync(self, key: str, out: memoryview | None) -> ChunkHeader | None:
        """The verified header, and the payload read into `out` (None: the header only)."""
        return self._read_sync(key, None if out is None else [out])[0]

    def _read_sync(self, key: str, parts: list[memoryview] | None, *,
                   resident_only: bool = False) -> tuple[ChunkHeader | None, str | None] | Any:
        """(verified header, None), with the payload read into `parts` (one buffer at least
        as long, or several that take it in order and exactly; None: the header only), or
        (None, why) on a miss: "missing", "corrupt" (quarantined, or another layout's
        payload that does not fit: left alone) or "io". The payload is checked per
        `verify=`, or with `resident_only` as a connector's direct reads check it (every
        payload not verified before); `resident_only` also reads nothing and answers
        NOT_RESIDENT unless every byte of the file is in the page cache."""
        return self._read_open(key, functools.partial(
            self._read_payload, key, parts, resident_only))

    def _read_open(self, key: str, read: Callable[[int, os.stat_result], Any]
                   ) -> tuple[ChunkHeader | None, str | None] | Any:
        """`read(fd, st)` of `key`'s chunk file, opened here and closed after: (its
        header, None), or (None, why) on a miss: "missing", "corrupt" (a ChunkError:
        quarantined) or "io". `read` may answer NOT_RESIDENT or (None, "corrupt") (left
        alone) itself; a read that answers a header refreshes the chunk's LRU place."""
        opened = self._open_for_read(key)
        if opened is None:
            return None, "missing"
        fd, path = opened
        try:
            st = os.fstat(fd)
            if self._oversize(key, st):
                return None, "corrupt"
            got = read(fd, st)
            if not isinstance(got, ChunkHeader):
                return got
        except ChunkError as exc:
            self._quarantine(key, path, str(exc))
            return None, "corrupt"
        except OSError as exc:
            if exc.errno in _MISS_ERRNOS:
                return None, "missing"
            self.counters["errors"] += 1
            return None, "io"
        finally:
            os.close(fd)
        self._touch(key, path, st)
        return got, None

    def _oversize(self, key: str, st: os.stat_result) -> bool:
        """Whether `key`'s file is over `max_chunk`: then a miss, counted as an error and
        left in place unread (no chunk this store reads is that large)."""
        if st.st_size <= self.max_chunk:
            return False
        self.counters["errors"] += 1
        log.debug("%s: %s is %d bytes, over max_chunk=%d: a miss", self, key, st.st_size,
                  self.max_chunk)
        return True

    def _read_payload(self, key: str, parts: list[memoryview] | None, resident_only: bool,
                      fd: int, st: os.stat_result) -> ChunkHeader | tuple[None, str] | Any:
        """`_read_sync`'s read of an open chunk file (`_read_open`)."""
        if resident_only and self.residency.all_cached(fd, 0, st.st_size) is not True:
            return NOT_RESIDENT
        room = -1 if parts is None else sum(p.nbytes for p in parts)
        # An unchanged, already verified file needs its header neither read nor parsed.
        known = self.known_header(key, st)
        header, read = known, False
        if header is None and parts is not None and st.st_size == HEADER_SIZE + room:
            # A chunk of the asked size with the usual 4 KiB header: header and
            # payload in one read. A longer header is read again below, and so is
            # its payload where it still fits `parts`.
            head = bytearray(HEADER_SIZE)
            if read_parts_at(fd, [memoryview(head), *parts], 0) != st.st_size:
                raise ChunkError("short read")
            try:
                header, read = decode_header(head, key), True
            except TruncatedHeader:
                pass
        if header is None:
            header = _read_header(fd, key)
        if st.st_size != header.total_len:
            raise ChunkError(f"file is {st.st_size} bytes, header says {header.total_len}")
        if parts is not None:
            if room < header.payload_len or (len(parts) > 1 and room != header.payload_len):
                return None, "corrupt"  # another layout's chunk: not this reader's to judge
            if len(parts) == 1:
                parts = [parts[0][: header.payload_len]]
            if not read and read_parts_at(fd, parts, header.header_len) != header.payload_len:
                raise ChunkError("short read")
            check = known is None if resident_only else self._needs_payload_check(key, st)
            if check:
                header.verify_payload(parts if len(parts) > 1 else parts[0])
                self.note_verified(key, st, header)
        return header

    def prefix_len_now(self, keys: Sequence[str]) -> int | None:
        """See SupportsResidentReads: `prefix_len` on this thread; None for a directory
        that is not local (NFS), whose lookups may wait on the network."""
        return self._prefix_len_sync(keys) if self._local else None

    def _prefix_len_sync(self, keys: Sequence[str]) -> int:
        for k in keys:
            check_key(k)
        return sum(self._exists_sync(keys, True))

    def cached_prefix_now(self, keys: Sequence[str]) -> list[bool] | None:
        """See SupportsResidentReads: per leading key held, whether its chunk file is all
        in the page cache; None for a directory that is not local."""
        if not self._local:
            return None
        for k in keys:
            check_key(k)
        out = []
        for k in keys:
            try:
                fd = os.open(_chunk_file(self._root, k), os.O_RDONLY | os.O_NOFOLLOW)
            except OSError as exc:
                if exc.errno in _MISS_ERRNOS:
                    break
                out.append(False)  # there, but not to be read here: its load will say
                continue
            try:
                out.append(self.residency.all_cached(fd, 0, os.fstat(fd).st_size) is True)
            except OSError:
                out.append(False)
            finally:
                os.close(fd)
        return out

    def is_resident(self, key: str) -> bool:
        """See SupportsResidentReads: whether `read_resident_into` would read `key` now."""
        return self.cached_prefix_now([key]) == [True]

    def read_resident_into(self, key: str, out: Any) -> tuple[ChunkHeader | None, str | None] | Any:
        """See SupportsResidentReads: `key`'s payload into `out` (a buffer, or a list of
        buffers that take it in order and exactly) on the calling thread, only where the
        store's directory is on a local filesystem and every byte of the chunk's file is
        in the page cache (else NOT_RESIDENT, nothing read). As for the direct reads of
        connectors (gds.ChunkIO), every payload not verified before (unchanged since) is
        checked, whatever `verify=`. Accounted as a `get_into` would be: a hit refreshes
        its LRU place, a corrupt file is quarantined, an absent one forgotten; a payload
        that does not fit `out` is a miss ("corrupt" for the caller), and nothing is read."""
        if not self._local:
            return NOT_RESIDENT
        check_key(key)
        parts = [memoryview(p).cast("B") for p in (out if isinstance(out, list) else [out])]
        got = self._read_sync(key, parts, resident_only=True)
        if got is not NOT_RESIDENT:
            self._count_get(None if got[0] is None else got[0].total_len)
        return got

    def read_resident_spans_into(self, key: str, spans: Sequence[tuple[int, int]],
                                 outs: Sequence[Any]) -> tuple[ChunkHeader | None, str | None] | Any:
        """See SupportsResidentReads: payload bytes [offset, offset + length) of each of
        `spans` (each a run of whole segments) into `outs[j]` (one buffer of that length
        each) on the calling thread, only where the store's directory is local and the
        header and every span are in the page cache (else NOT_RESIDENT: the caller reads
        them the normal way). Nothing else of the chunk is read. Each span is checked against the segments it
        covers unless this very file was verified whole before; accounted as
        `read_resident_into`: a corrupt file is quarantined, a span that is not a run of
        whole segments (no segment checksums, another layout) is a miss ("corrupt")."""
        if not self._local:
            return NOT_RESIDENT
        check_key(key)
        views = [memoryview(o).cast("B") for o in outs]
        got = self._read_open(key, functools.partial(self._read_spans, key, spans, views))
        if got is not NOT_RESIDENT:
            self._count_get(None if got[0] is None else got[0].total_len)
        return got

    def _read_spans(self, key: str, spans: Sequence[tuple[int, int]], views: list[memoryview],
                    fd: int, st: os.stat_result) -> ChunkHeader | tuple[None, str] | Any:
        """`read_resident_spans_into`'s read of an open chunk file (`_read_open`)."""
        all_cached = self.residency.all_cached
        known = self.known_header(key, st)
        # Spans follow a header of HEADER_SIZE until the header says otherwise (a
        # longer one: checked again once read).
        base = HEADER_SIZE if known is None else known.header_len
        if (all_cached(fd, 0, min(base, st.st_size)) is not True
                or any(all_cached(fd, base + off, size) is not True for off, size in spans)):
            return NOT_RESIDENT
        header, read = known, -1
        if header is None:
            head = bytearray(HEADER_SIZE)
            # The header and a first span at the payload's start in one read.
            with_first = bool(spans) and spans[0][0] == 0
            got = read_parts_at(fd, [memoryview(head), *(views[:1] if with_first else [])], 0)
            try:
                header = decode_header(head, key)
                read = 0 if with_first and got == HEADER_SIZE + views[0].nbytes else -1
            except TruncatedHeader:
                header = _read_header(fd, key)
            if header.header_len != base and any(
                    all_cached(fd, header.header_len + off, size) is not True
                    for off, size in spans):
                return NOT_RESIDENT
        if st.st_size != header.total_len:
            raise ChunkError(f"file is {st.st_size} bytes, header says {header.total_len}")
        if not header.aligned(spans) or any(
                v.nbytes != size for v, (_, size) in zip(views, spans, strict=True)):
            return None, "corrupt"  # not this reader's to judge: left alone
        for j, ((off, size), view) in enumerate(zip(spans, views, strict=True)):
            if j != read and read_into_at(fd, view, header.header_len + off) != size:
                raise ChunkError("short read")
            if known is None and not header.span_intact(off, [view]):
                raise ChunkError(f"payload bytes at {off} fail their segment checksums "
                                 f"for {key}")
        if known is None and sum(size for _, size in spans) == header.payload_len:
            self.note_verified(key, st, header)
        return header

    def open_segments(self, key: str) -> tuple[SegmentFile | None, str | None] | Any:
        """See SupportsResidentReads: `key`'s chunk file open for reads by segment on the
        calling thread, or (None, "missing"); NOT_RESIDENT for a directory that is not
        local. Nothing is read or stat'ed here."""
        if not self._local:
            return NOT_RESIDENT
        check_key(key)
        opened = self._open_for_read(key)
        if opened is None:
            self._count_get(None)
            return None, "missing"
        return SegmentFile(self, key, *opened), None

    def _exists_sync(self, keys: Sequence[str], stop_at_gap: bool) -> list[bool]:
        # Plain strings and access(F_OK): a Path per key costs 4x the syscall itself, and
        # access() builds no stat result (half the time of os.path.exists here); a lookup
        # may carry thousands of keys.
        root = self._root
        access, exists = os.access, os.F_OK
        out = []
        for k in keys:
            present = access(_chunk_file(root, k), exists)
            out.append(present)
            if stop_at_gap and not present:
                break
        return out

    def _evict_to(self, target: int, count_extra: bool = True) -> int:
        """Evict least recently used chunks until this store holds at most `target` bytes
        (with `count_extra`, other writers' tmp files and the quarantine count too); the
        bytes of the files unlinked here."""
        freed = 0
        while True:
            with self._lock:
                extra = self._tmp_bytes + self._quarantine_bytes if count_extra else 0
                if self._used + extra <= target or not self._index:
                    return freed
                victim, size = self._index.popitem(last=False)
                self._used -= size
            self._verified.pop(self._root, victim)
            try:
                self._unlink_inside(_chunk_path(self.root, victim))
                self.counters["evictions"] += 1
                freed += size
                self._ledger_add(self.scope, -size)
            except OSError:
                pass
            self._changed("removed", victim)

    def _leads_out(self, leaf: Path | str) -> bool:
        """`_leaves_root` for the fan-out directory `leaf`, remembering those found real
        (the three lstat calls took 11 us on the loaded 2-core VM: several % of a
        page-cached 4 MiB read)."""
        path = os.fspath(leaf)
        if path in self._real_dirs:
            return False
        out = _leaves_root(path)
        if out is False:
            if len(self._real_dirs) >= _REAL_DIRS_MAX:
                self._real_dirs.clear()
            self._real_dirs.add(path)
        return bool(out)

    def _unlink_inside(self, path: Path) -> None:
        """Unlink the chunk file `path`; FileNotFoundError where its directories lead out
        of the root (nothing of this store is there)."""
        if self._leads_out(path.parent):
            raise FileNotFoundError(errno.ENOENT, "outside the store root", str(path))
        path.unlink()

    # -- the Store protocol --------------------------------------------------------------

    def _check_and_put_sync(self, key: str, blob: Any) -> bool:
        # The header now; the payload hash on the worker while the disk syncs (see _put_sync).
        header = check_blob_header(key, blob)
        return self._put_sync(key, memoryview(blob).cast("B"),
                              lambda: check_blob_payload(header, blob))

    async def put(self, key: str, blob: Any) -> bool:
        check_key(key)
        try:
            wrote = await asyncio.to_thread(self._check_and_put_sync, key, blob)
        except (StoreFull, StoreUnavailable):
            self.counters["put_errors"] += 1
            raise
        if wrote:
            self.counters["puts"] += 1
            self.counters["bytes_written"] += len(blob)
            self._changed("stored", key)
        else:
            self.counters["put_skipped"] += 1
        return wrote

    async def get(self, key: str) -> bytes | None:
        check_key(key)
        blob = await asyncio.to_thread(self._get_sync, key)
        self._count_get(None if blob is None else len(blob))
        return blob

    async def get_blob_into(self, key: str, out: Any) -> memoryview | None:
        return await self._blob(key, out, as_file=False)  # type: ignore[return-value]

    async def open_blob(self, key: str, out: Any) -> memoryview | BlobFile | None:
        return await self._blob(key, out, as_file=True)

    async def _blob(self, key: str, out: Any, as_file: bool) -> memoryview | BlobFile | None:
        check_key(key)
        got = await asyncio.to_thread(self._get_sync, key, memoryview(out).cast("B"), as_file)
        if isinstance(got, BlobFile):
            self._count_get(got.size)
            return got
        self._count_get(None if got is None else len(got))
        return None if got is None else memoryview(got)

    async def get_into(self, key: str, out: Any) -> ChunkHeader | None:
        check_key(key)
        header = await asyncio.to_thread(self._get_into_sync, key, memoryview(out).cast("B"))
        self._count_get(None if header is None else header.total_len)
        return header

    async def get_into_many(
        self,
        keys: Sequence[str],
        outs: Sequence[Any],
        *,
        max_in_flight: int = 4,
        on_done: Callable[[int, ChunkHeader | None], bool | None] | None = None,
    ) -> list[ChunkHeader | None]:
        """One hand-off per worker thread, not per key: each of `max_in_flight` threads takes
        the next unread index until none is left. (Waking a thread and then the loop costs
        0.2-0.4 ms on a VM, as much as reading a page-cached 4 MiB chunk.) `on_done` runs
        on the worker thread."""
        check_batch(keys, outs)
        for k in keys:
            check_key(k)
        views = [memoryview(o).cast("B") for o in outs]
        results: list[ChunkHeader | None] = [None] * len(keys)
        read = [False] * len(keys)
        order = iter(range(len(keys)))  # next() on a range iterator is atomic under the GIL
        stop = threading.Event()

        def worker() -> None:
            while not stop.is_set():
                i = next(order, None)
                if i is None:
                    return
                results[i] = header = self._get_into_sync(keys[i], views[i])
                read[i] = True
                if on_done is not None and on_done(i, header) is False:
                    stop.set()

        workers = min(max(max_in_flight, 1), len(keys))
        try:
            await asyncio.gather(*(asyncio.to_thread(worker) for _ in range(workers)))
        finally:
            stop.set()  # cancelled or failed: start no further reads
            for header, done in zip(results, read, strict=True):
                if done:
                    self._count_get(None if header is None else header.total_len)
        return results

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        for k in keys:
            check_key(k)
        return await asyncio.to_thread(self._exists_sync, keys, False)

    async def prefix_len(self, keys: Sequence[str]) -> int:
        return await asyncio.to_thread(self._prefix_len_sync, keys)

    async def delete(self, key: str) -> bool:
        check_key(key)
        reported = self._forget(key)
        try:
            await asyncio.to_thread(self._delete_sync, key)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreUnavailable(f"{self}: delete {key} failed: {exc.strerror}") from exc
        self.counters["deletes"] += 1
        if not reported:  # a file this process had not indexed (another writer's)
            self._changed("removed", key)
        return True

    def _delete_sync(self, key: str) -> None:
        path = _chunk_path(self.root, key)
        size = os.lstat(path).st_size
        self._unlink_inside(path)
        self._ledger_add(self.scope, -size)

    async def list_keys(self) -> AsyncIterator[str]:
        """Every chunk key of this store's layout, streamed from the directory walk a batch
        at a time (each batch read on a worker thread): a listing holds one batch and the
        walk's open directories, never the whole listing."""
        walk = self._walk_keys()
        try:
            while True:
                batch = await asyncio.to_thread(_next_batch, walk, _LIST_BATCH)
                for key in batch:
                    yield key
                if len(batch) < _LIST_BATCH:
                    return
        finally:
            # Closes the directories still open; a listing cancelled while a thread walks
            # leaves that to the walk's own finalizer once the thread is done.
            with contextlib.suppress(ValueError):
                walk.close()

    def _walk_keys(self) -> Generator[str, None, None]:
        """The keys of the chunk files under the root, as `_scan` finds them, one at a time."""
        try:
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            for leaf_fd, (ns_id, d1, d2) in _layout_dirs(root_fd, (16, 2, 2)):
                fanout = d1 + d2
                try:
                    with os.scandir(leaf_fd) as it:
                        for e in it:
                            name = e.name
                            if (name.endswith(SUFFIX) and _is_hex(name[:-3], 32)
                                    and name.startswith(fanout) and e.is_file(follow_symlinks=False)):
                                yield f"{ns_id}/{name[:-3]}"
                except OSError:
                    continue
        finally:
            os.close(root_fd)

    async def gc(self, capacity: int) -> dict[str, Any]:
        """Rescan the whole root, its tenants' directories included, and evict least
        recently used chunks, from the scope holding the most bytes first, until the root
        holds at most `capacity` bytes (chunk files, other writers' tmp files, quarantine).
        Done under the root's usage lock, whose count it then sets right."""
        return await asyncio.to_thread(self._gc_sync, capacity)

    def _gc_sync(self, capacity: int) -> dict[str, Any]:
        if self._ledger is None and os.path.lexists(self._top / LEDGER):
            # Servers with capacity= count this root: take their lock and set their count.
            ledger = RootLedger(self._top, self.mode)
            for member in self._family.values():
                member._ledger = ledger
            self._owns_ledger = True
        with self._ledger.locked() if self._ledger is not None else contextlib.nullcontext():
            members = [m for scope, _ in _scope_dirs(self._top) if (m := self._member(scope))]
            before = sum(m.counters["evictions"] for m in members)
            for member in members:
                member._rebuild_index()
            if self._ledger is not None:
                self._recount()
            over = self._root_bytes(members) - capacity
            if over > 0:
                self._free_across(over)
            used = self._root_bytes(members)
        return {"evicted": sum(m.counters["evictions"] for m in members) - before,
                "used_bytes": used, "chunks": sum(len(m._index) for m in members),
                "tenants": len(members) - 1}

    def _root_bytes(self, members: list[FileStore]) -> int:
        if self._ledger is not None:
            with self._ledger.locked() as usage:
                return sum(usage.values())
        total = 0
        for m in members:
            with m._lock:
                total += m._used + m._tmp_bytes + m._quarantine_bytes
        return total

    def root_usage(self) -> dict[str, Any]:
        """What a scan of the whole root finds now, its tenants' directories included:
        `used_bytes` (chunk files, other writers' tmp files and quarantine, as `du
        --apparent-size` counts them), `chunks`, and the same per tenant."""
        scopes = scan_root(self._top, self.tmp_grace_s)
        per = {scope: {"chunks": found["chunks"],
                       "used_bytes": found["bytes"] + found["quarantine_bytes"]}
               for scope, found in scopes.items()}
        return {"used_bytes": sum(p["used_bytes"] for p in per.values()),
                "chunks": sum(p["chunks"] for p in per.values()),
                "tenants": {scope: p for scope, p in per.items() if scope}}

    # -- direct reads: gds.ChunkIO straight into destination tensors (SupportsDirectReads)
    # The ChunkIO comes from above (`gds.enable_direct_reads` builds one for this directory):
    # storage never imports gds.

    def direct_reads_home(self) -> tuple[str, Residency]:
        """Where a ChunkIO for this store probes the filesystem, and the page-cache oracle
        that decides which of its reads take O_DIRECT."""
        return self._root, self.residency

    def enable_direct_reads(self, chunk_io: ChunkIO, *, owned: bool = False) -> ChunkIO:
        """Read chunks through `chunk_io` from now on (see SupportsDirectReads) and return it;
        `owned`: this store closes it (with itself, or when another replaces it)."""
        if chunk_io is self._chunk_io:
            return chunk_io
        if self._chunk_io is not None and self._owns_chunk_io:
            self._chunk_io.close()
        self._chunk_io, self._owns_chunk_io = chunk_io, owned
        return chunk_io

    @property
    def chunk_io(self) -> ChunkIO | None:
        """The ChunkIO direct reads go through, or None before `enable_direct_reads`."""
        return self._chunk_io

    async def read_chunks_into(
        self, keys: Sequence[str], dests: Sequence[Any], *,
        on_done: Callable[[int, ChunkHeader | None, str | None], bool | None] | None = None,
    ) -> list[ChunkHeader | None]:
        """See SupportsDirectReads. The store is told of each read as if it had done it: a
        hit refreshes its LRU place, a corrupt file is quarantined, an absent one forgotten;
        a file this store verified before and that is unchanged since is read without its
        header and checksum (`verify=changed`)."""
        check_batch(keys, dests)
        io = self._chunk_io
        if io is None:
            raise RuntimeError(f"{self}: direct reads are not enabled (gds.enable_direct_reads)")
        results: list[ChunkHeader | None] = [None] * len(keys)

        def landed(i: int, header: ChunkHeader | None, failure: ReadError | None) -> bool | None:
            key = keys[i]
            if failure is None and header is not None:
                self.record_read(key, header.total_len)
            elif failure is not None:  # the reasons of gds.errors
                self.record_read(key, None, error=failure.reason == "io",
                                 corrupt=failure.detail if failure.reason == "corrupt" else None)
            results[i] = header
            why = None if failure is None else failure.reason
            return on_done(i, header, why) if on_done is not None else None

        await io.read_chunks_into([self.chunk_path(k) for k in keys], dests, keys, landed,
                                  trust=self)
        return results

    # -- ranged reads (SupportsRangeReads) --------------------------------------------------

    async def read_header(self, key: str) -> ChunkHeader | None:
        """The verified header of `key`'s file (which must be as long as it says); a corrupt
        header is quarantined. A hit refreshes the chunk's LRU place."""
        check_key(key)
        header = await asyncio.to_thread(self._get_into_sync, key, None)
        self._count_get(None if header is None else header.total_len)
        return header

    async def read_range_into(self, key: str, header: ChunkHeader, offset: int, out: Any) -> bool:
        """Payload bytes [offset, offset + len(out)) of `key`'s file; the caller verifies
        them against the header's segment checksums."""
        check_key(key)
        view = memoryview(out).cast("B")
        if offset < 0 or offset + view.nbytes > header.payload_len:
            return False
        return await asyncio.to_thread(self._read_range_sync, key, header, offset, view)

    def _read_range_sync(self, key: str, header: ChunkHeader, offset: int, view: memoryview) -> bool:
        opened = self._open_for_read(key)
        if opened is None:
            return False
        fd, _ = opened
        try:
            if os.fstat(fd).st_size != header.total_len:  # replaced since its header was read
                return False
            return read_into_at(fd, view, header.header_len + offset) == view.nbytes
        except OSError as exc:
            if exc.errno not in _MISS_ERRNOS:
                self.counters["errors"] += 1
            return False
        finally:
            os.close(fd)

    async def close(self) -> None:
        await super().close()
        if self._chunk_io is not None and self._owns_chunk_io:
            self._chunk_io.close()
        self._chunk_io = None
        if self._ledger is not None and self._owns_ledger:
            self._ledger.close()

    # -- reads done by a reader outside the store (gds.ChunkIO's `trust=`) ---------------

    def chunk_path(self, key: str) -> Path:
        """The file that holds `key` (it may not exist)."""
        check_key(key)
        return _chunk_path(self.root, key)

    def record_read(self, key: str, size: int | None, *, corrupt: str | None = None,
                    error: bool = False) -> None:
        """Account for a read of `key` that another reader did from `chunk_path(key)`: a hit
        of `size` bytes refreshes its LRU place; a miss (None) is counted; `corrupt` (why
        the reader rejected the file's bytes) quarantines the file as a read here would;
        `error` counts an I/O error."""
        path = _chunk_path(self.root, key)
        if corrupt is not None:
            self._quarantine(key, path, corrupt)
        elif error:
            self.counters["errors"] += 1
        elif size is not None:
            try:
                self._touch(key, path, os.stat(path))
            except OSError:
                pass
        else:
            self._forget(key)
        self._count_get(size)

    async def evict_to(self, used_bytes: int) -> int:
        with self._lock:
            before = self._used
        await asyncio.to_thread(self._evict_to, used_bytes)
        with self._lock:
            return max(before - self._used, 0)

    async def health(self) -> str | None:
        return await asyncio.to_thread(self._health_sync)

    def _health_sync(self) -> str | None:
        try:
            if not self.root.is_dir():
                return f"store root {self.root} is missing or not a directory"
            vfs = os.statvfs(self.root)
        except OSError as exc:
            return f"store root {self.root} cannot be checked: {exc.strerror}"
        if vfs.f_flag & os.ST_RDONLY or not os.access(self.root, os.W_OK):
            return f"store root {self.root} is read-only"
        if vfs.f_bavail * vfs.f_frsize < MIN_FREE_BYTES:
            return f"disk of {self.root} is full ({vfs.f_bavail * vfs.f_frsize} bytes free)"
        return None

    def scoped(self, tenant: str) -> FileStore:
        """The store of `tenant`'s chunks, `<root>/tenants/<tenant>/`, sharing this root's
        capacity count and verified-header cache."""
        check_tenant(tenant)
        tenants = self._top / TENANTS
        try:
            os.mkdir(tenants, self.dir_mode)
        except FileExistsError:
            pass
        except OSError as exc:
            raise ConfigError(f"{self}: cannot create {tenants}: {exc.strerror}") from exc
        for d in (tenants, tenants / tenant):
            if d.is_symlink():
                raise ConfigError(f"{self}: {d} is a symlink; a tenant's chunks stay inside the root")
        return FileStore(
            tenants / tenant, self.capacity, fsync=self.fsync, verify=self.verify,
            tmp_grace_s=self.tmp_grace_s, mode=self.mode,
            url=f"{self.url.partition('#')[0]}#{tenant}", verified=self._verified,
            scope=tenant, family=self._family, ledger=self._ledger, residency=self.residency,
            settle_s=self.settle_s, max_chunk=self.max_chunk,
        )

    def stats(self) -> dict[str, Any]:
        with self._lock:
            tmp, quarantine = self._tmp_bytes, self._quarantine_bytes
            used, n = self._used + tmp + quarantine, len(self._index)
            quarantined = self._quarantined
        out = {
            **super().stats(), "backend": "file", "root": str(self.root), "used_bytes": used,
            "capacity_bytes": self.capacity, "chunks": n, "used": format_size(used),
            "tmp_bytes": tmp, "quarantine_bytes": quarantine, "quarantined_files": quarantined,
            "quarantine_max_bytes": self.quarantine_max,
        }
        if self._ledger is not None and not self.scope:
            # The root's bytes as the processes sharing its capacity count them (as of this
            # process's last use of the count); never in a tenant's stats, which show that
            # tenant alone.
            out["root_used_bytes"] = self._ledger.total()
        return out


def _checks_whole(path: Path, key: str, max_chunk: int) -> bool:
    """Whether the regular file at `path` is a whole, valid chunk of `key`: header, length,
    payload checksum and every segment's checksum, read into memory of its own (a file
    over `max_chunk` is not read, and is not one)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        if size > max_chunk:
            return False
        blob = read_at(fd, size)
        if len(blob) != size:
            return False
        header = decode_chunk(blob, key).header
        payload = memoryview(blob)[header.header_len :]
        for i, (offset, length, _) in enumerate(header.segments):
            header.verify_segment(i, payload[offset : offset + length])
        return True
    except (OSError, ChunkError):
        return False
    finally:
        os.close(fd)


class SegmentFile:
    """One chunk file open for reads of its payload a segment at a time, on the calling
    thread (`FileStore.open_segments`), each segment checked against its own checksum; a
    file that fails a check is quarantined. Made for a thread that reads while an engine
    computes: every call it makes holds Python's lock that the engine's thread needs
    between its operations (on a 2-vCPU VM a reader on the other core with a stat, a
    cache probe and the bookkeeping of a whole read per chunk slowed a loop of small
    torch ops by 23 %, raw reads and checksums alone by 9 %, 2026-11-27), so it makes as
    few as it can: no stat before the reads, and reads of page-cached bytes only (the
    store's `residency.read_nowait`: preadv RWF_NOWAIT), which answer NOT_RESIDENT rather
    than wait on the disk while `resident` holds. `head` reads the header (with the first
    range in the same read where it can), `read` one segment, `read_span` one run of whole
    segments (a layer's part, or a tensor-parallel rank's heads of it); `close` does the
    accounting."""

    def __init__(self, store: FileStore, key: str, fd: int, path: str):
        self.store, self.key = store, key
        self._fd, self._path = fd, path
        self.header: ChunkHeader | None = None
        self.resident = True  # no read has had to wait on the disk
        self._done: set[int] = set()  # segments read and checked
        self._spans: set[tuple[int, int]] = set()  # (offset, length) read and checked
        self._failed = False
        self._read_nowait = store.residency.read_nowait

    def _pread(self, parts: list[memoryview], offset: int, length: int) -> bool:
        """Fill `parts` (`length` bytes) from `offset`; False where `resident` and not all
        of it was in the page cache (nothing waited for; `resident` turns False)."""
        if self.resident:
            if self._read_nowait(self._fd, parts, offset) == length:
                return True
            self.resident = False
            return False
        if read_parts_at(self._fd, parts, offset) != length:
            raise ChunkError("short read")
        return True

    def head(self, first: list[memoryview], wait: bool = True,
             offset: int = 0) -> ChunkHeader | None | Any:
        """The header, checked (its checksum, the key), or None on a miss. Where the file
        is the usual 4 KiB header, `offset` is 0 and payload bytes [0, len(first)) are a
        run of whole segments (`first`: buffers that take them in order) all in the page
        cache, they land there in the same read and are checked: `read_span(0, first)`
        then reads nothing. `wait=False`: where that read would have waited on the disk,
        NOT_RESIDENT instead (nothing else read)."""
        try:
            n0 = sum(p.nbytes for p in first) if offset == 0 else 0
            head = bytearray(HEADER_SIZE)
            if self._pread([memoryview(head), *(first if n0 else [])], 0, HEADER_SIZE + n0):
                try:
                    header = decode_header(head, self.key)
                except TruncatedHeader:
                    header = _read_header(self._fd, self.key)
                else:
                    covered = header.span_segments(0, n0) if n0 else None
                    if header.header_len == HEADER_SIZE and covered is not None:
                        if not header.span_intact(0, first):
                            raise ChunkError(f"segment checksum mismatch for {self.key}")
                        self._done.update(covered)
                        self._spans.add((0, n0))
            elif not wait:
                return NOT_RESIDENT
            else:
                header = _read_header(self._fd, self.key)
            self.header = header
            return header
        except (ChunkError, OSError) as exc:
            self._fail(exc)
            return None

    def read_all(self, segments: list[list[memoryview]]) -> bool | None:
        """The header and the whole payload, range s into `segments[s]` (buffers that take
        it in order; consecutive ranges from the payload's start, each a run of whole
        segments, e.g. one layer's part) in one read of page-cached bytes, each segment
        checked: True once all is read and checked, None on a miss (a check failed), False
        where this file cannot be read so (a byte not in the page cache, a header longer
        than 4 KiB, ranges that are not runs of whole segments): `head` and `read_span`
        then read it, nothing judged yet. For a reader that needs no range before the
        others (one read where `head` and `read_span` make one a range)."""
        head = bytearray(HEADER_SIZE)
        flat = [memoryview(head)]
        lengths = []
        for parts in segments:
            flat.extend(parts)
            lengths.append(sum(p.nbytes for p in parts))
        try:
            n = self._read_nowait(self._fd, flat, 0)
        except OSError as exc:
            self._fail(exc)
            return None
        if n != HEADER_SIZE + sum(lengths):
            return False
        try:
            header = decode_header(head, self.key)
        except TruncatedHeader:
            return False
        except ChunkError as exc:
            self._fail(exc)
            return None
        offsets = [0, *itertools.accumulate(lengths[:-1])]
        if (header.header_len != HEADER_SIZE or sum(lengths) != header.payload_len
                or not header.aligned(zip(offsets, lengths, strict=True))):
            return False
        for s, parts in enumerate(segments):
            if not header.span_intact(offsets[s], parts):
                self._fail(ChunkError(f"range {s} checksum mismatch for {self.key}"))
                return None
        self.header = header
        self._done.update(range(len(header.segments)))
        return True

    def read(self, s: int, parts: list[memoryview]) -> bool | Any:
        """Segment s of the payload into `parts` (buffers that take it in order and
        exactly), checked: True, False on a miss, or NOT_RESIDENT (see `resident`: read
        it again, into memory that may be written late, with `resident` now False)."""
        if s in self._done:
            return True
        header = self.header
        try:
            if header is None or self._failed or not 0 <= s < len(header.segments):
                return False
            offset, length, _ = header.segments[s]
            if sum(p.nbytes for p in parts) != length:
                return False  # another layout's chunk: not this reader's to judge
            if not self._pread(parts, header.header_len + offset, length):
                return NOT_RESIDENT
            header.verify_segment(s, parts)
            self._done.add(s)
            return True
        except (ChunkError, OSError) as exc:
            self._fail(exc)
            return False

    def read_span(self, offset: int, parts: list[memoryview]) -> bool | Any:
        """Payload bytes [offset, offset + their length) into `parts` (buffers that take
        them in order and exactly), a run of whole segments, each checked: True, False on
        a miss (or bytes that are not such a run: another layout's chunk, not this
        reader's to judge), or NOT_RESIDENT (see `read`)."""
        length = sum(p.nbytes for p in parts)
        if (offset, length) in self._spans:
            return True
        header = self.header
        try:
            covered = None if header is None else header.span_segments(offset, length)
            if header is None or self._failed or covered is None:
                return False
            if not self._pread(parts, header.header_len + offset, length):
                return NOT_RESIDENT
            if not header.span_intact(offset, parts):
                raise ChunkError(f"payload bytes at {offset} fail their segment checksums "
                                 f"for {self.key}")
            self._done.update(covered)
            self._spans.add((offset, length))
            return True
        except (ChunkError, OSError) as exc:
            self._fail(exc)
            return False

    def read_payload(self, out: memoryview) -> bool:
        """The whole payload into the first bytes of `out`, checked against the payload
        checksum (a chunk saved without segment checksums); False on a miss. Waits on the
        disk where it must."""
        header = self.header
        try:
            if header is None or self._failed or out.nbytes < header.payload_len:
                return False
            view = out[: header.payload_len]
            if read_parts_at(self._fd, [view], header.header_len) != header.payload_len:
                raise ChunkError("short read")
            header.verify_payload(view)
            self._done.update(range(len(header.segments)))
            return True
        except (ChunkError, OSError) as exc:
            self._fail(exc)
            return False

    def _fail(self, exc: ChunkError | OSError) -> None:
        self._failed = True
        if isinstance(exc, ChunkError):
            self.store._quarantine(self.key, self._path, str(exc))
        elif exc.errno not in _MISS_ERRNOS:
            self.store.counters["errors"] += 1

    def close(self) -> None:
        """Close the file and count the read: a hit (its place in the LRU refreshed) where
        the header checked and nothing failed."""
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        store, header = self.store, self.header
        try:
            if self._failed or header is None:
                store._count_get(None)
                return
            st = os.fstat(fd)
            store._count_get(header.total_len)
            store._touch(self.key, self._path, st)
            if header.segments and len(self._done) == len(header.segments):
                store.note_verified(self.key, st, header)
        except OSError:
            pass
        finally:
            os.close(fd)

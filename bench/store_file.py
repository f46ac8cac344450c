"""Raw-file baselines for `kvstash bench store --store file://...`.

get: plain `os.preadv` of the very same chunk files into the very same preallocated buffers
as the store's reads (`raw_get_round`). put: plain write + fsync + rename of the same chunk
bytes as files in the same filesystem (`raw_put_round`). Both are timed in the same
rounds as the store, interleaved with it, at the same concurrency (threads).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from storage.codec import HEADER_SIZE
from storage.file import _chunk_path
from storage.options import StoreURL


def _write_fsync_rename(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view.nbytes:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)


def _preadv_file(path: Path, payload: memoryview) -> None:
    """The whole file with plain preadv: its header page into scratch, the rest into `payload`."""
    head = bytearray(HEADER_SIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        iov = [memoryview(head), payload[: size - HEADER_SIZE]]
        off = 0
        while off < size:
            n = os.preadv(fd, iov, off)
            if n == 0:
                break
            off += n
            iov = _skip(iov, n)
    finally:
        os.close(fd)


def _skip(iov: list, n: int) -> list:
    out = []
    for part in iov:
        view = memoryview(part)
        if n >= view.nbytes:
            n -= view.nbytes
            continue
        out.append(view[n:])
        n = 0
    return out


def _run(pool: ThreadPoolExecutor, fn, items) -> float:
    t0 = time.perf_counter()
    list(pool.map(fn, items))
    return time.perf_counter() - t0


RAW_GET_NAME = "raw preadv, same files"


def raw_get_round(url: str, keys: list[str], buffers: list[memoryview], concurrency: int) -> float:
    """Seconds to preadv every chunk file of `keys`, whole, chunk i into `buffers[i]` (the
    store's own destinations; the file's 4 KiB header page goes to scratch memory, as the
    store reads it apart), on `concurrency` threads."""
    root = Path(StoreURL(url).path)
    jobs = [(_chunk_path(root, k), b) for k, b in zip(keys, buffers, strict=True)]
    with ThreadPoolExecutor(concurrency) as pool:
        return _run(pool, lambda job: _preadv_file(*job), jobs)


RAW_PUT_NAME = "raw write+fsync+rename"


def raw_put_round(url: str, blobs: list[bytes], concurrency: int) -> tuple[float, Callable[[], None]]:
    """Seconds to write each blob as a file with plain write + fsync + rename on
    `concurrency` threads, in a scratch directory of the store's filesystem, and the call
    that removes that directory."""
    root = Path(StoreURL(url).path) / f".bench-baseline-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    jobs = [(root / f"{i:04d}", blob) for i, blob in enumerate(blobs)]
    with ThreadPoolExecutor(concurrency) as pool:
        seconds = _run(pool, lambda job: _write_fsync_rename(*job), jobs)
    return seconds, lambda: shutil.rmtree(root, ignore_errors=True)


async def baselines(args: argparse.Namespace, url: str, size: int, count: int,
                    concurrency: int) -> list[dict]:
    return []  # both raw baselines run interleaved with the store: raw_get_round, raw_put_round

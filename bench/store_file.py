"""Raw-file baselines for `kvstash bench store --store file://...`.

get: plain `os.preadv` of the very same chunk files into preallocated buffers, timed in the
same rounds as the store's reads (`raw_get_round`). put: plain write + fsync + rename of
same-sized files in the same filesystem. Same concurrency (threads).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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


def _preadv_all(path: Path, buf: bytearray) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        view, off = memoryview(buf), 0
        while off < len(buf):
            n = os.preadv(fd, [view[off:]], off)
            if n == 0:
                break
            off += n
    finally:
        os.close(fd)


def _run(pool: ThreadPoolExecutor, fn, items) -> float:
    t0 = time.perf_counter()
    list(pool.map(fn, items))
    return time.perf_counter() - t0


RAW_GET_NAME = "raw preadv, same files"


def raw_get_round(url: str, keys: list[str], concurrency: int) -> float:
    """Seconds to preadv every chunk file of `keys` into preallocated buffers."""
    root = Path(StoreURL(url).path)
    paths = [_chunk_path(root, k) for k in keys]
    size = max(p.stat().st_size for p in paths)
    buffers = [bytearray(size) for _ in range(concurrency)]
    idx = {p: i % concurrency for i, p in enumerate(paths)}
    with ThreadPoolExecutor(concurrency) as pool:
        return _run(pool, lambda p: _preadv_all(p, memoryview(buffers[idx[p]])[: p.stat().st_size]), paths)


async def baselines(args: argparse.Namespace, url: str, size: int, count: int,
                    concurrency: int) -> list[dict]:
    root = Path(StoreURL(url).path) / f".bench-baseline-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    data = os.urandom(size + 4096)
    paths = [root / f"{i:04d}" for i in range(count)]

    def measure() -> float:
        with ThreadPoolExecutor(concurrency) as pool:
            return _run(pool, lambda p: _write_fsync_rename(p, data), paths)

    try:
        put_s = await asyncio.to_thread(measure)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return [{"name": "raw write+fsync+rename", "put_gbps": len(data) * count / put_s / 1e9,
             "get_gbps": None}]

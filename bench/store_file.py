"""Raw-file baselines for `kvstash bench store --store file://...`.

get: plain `os.preadv` of the same number of same-sized files into a preallocated buffer.
put: plain write + fsync + rename. Same directory tree, same concurrency (threads).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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


async def baselines(args: argparse.Namespace, url: str, size: int, count: int,
                    concurrency: int) -> list[dict]:
    root = Path(StoreURL(url).path) / f".bench-baseline-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    data = os.urandom(size + 4096)
    paths = [root / f"{i:04d}" for i in range(count)]
    rounds = getattr(args, "rounds", 3)
    buffers = {i: bytearray(len(data)) for i in range(concurrency)}

    def measure() -> tuple[float, float]:
        with ThreadPoolExecutor(concurrency) as pool:
            put_s = _run(pool, lambda p: _write_fsync_rename(p, data), paths)
            idx = {p: i % concurrency for i, p in enumerate(paths)}
            get_s = statistics.median(
                _run(pool, lambda p: _preadv_all(p, buffers[idx[p]]), paths) for _ in range(rounds)
            )
        return put_s, get_s

    try:
        put_s, get_s = await asyncio.to_thread(measure)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = len(data) * count
    return [{"name": "raw preadv / write+fsync+rename", "put_gbps": nbytes / put_s / 1e9,
             "get_gbps": nbytes / get_s / 1e9}]

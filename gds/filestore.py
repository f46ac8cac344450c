"""Reading a FileStore's chunks straight into destination tensors through ChunkIO.

`enable_direct_reads(store)` hands a store that reads directly (`SupportsDirectReads`:
file://, a tier list over it) its ChunkIO: gds sits above storage, which never imports it.
The store's layout (`FileStore.chunk_path`) names the file of each key; ChunkIO verifies
each header against its key (and token ids, when given) and lands the payload in its
destination. A failed key is a miss (None), never an exception: absent, evicted, corrupt
and unreadable chunks all read as None, and ChunkIO's stats count the reasons.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from gds.chunkio import ChunkIO, IOConfig
from gds.errors import ReadError
from storage.capabilities import SupportsDirectReads
from storage.codec import ChunkHeader
from storage.file import FileStore


def enable_direct_reads(store: SupportsDirectReads, chunk_io: ChunkIO | None = None, *,
                        max_in_flight: int = 8) -> ChunkIO:
    """Turn on `store`'s direct reads and return the ChunkIO they go through: `chunk_io`
    (shared: its owner closes it), else the store's own, built once for its directory
    (probing the filesystem and the GPU) and closed with the store."""
    if chunk_io is not None:
        return store.enable_direct_reads(chunk_io)
    if store.chunk_io is not None:
        return store.chunk_io
    root, residency = store.direct_reads_home()
    own = ChunkIO(IOConfig(max_in_flight=max_in_flight), probe_dir=root, residency=residency)
    return store.enable_direct_reads(own, owned=True)


def submit_store_chunks(io: ChunkIO, store: FileStore, keys: Sequence[str], dests: Sequence[Any],
                        token_ids: Sequence[Any] | None = None) -> list[Future]:
    if len(dests) != len(keys) or (token_ids is not None and len(token_ids) != len(keys)):
        raise ValueError("keys, dests and token_ids must have the same length")
    return [
        io.submit_chunk(store.chunk_path(key), dest, key,
                        None if token_ids is None else token_ids[i], trust=store)
        for i, (key, dest) in enumerate(zip(keys, dests, strict=True))
    ]


def read_store_chunks(io: ChunkIO, store: FileStore, keys: Sequence[str], dests: Sequence[Any],
                      token_ids: Sequence[Any] | None = None) -> list[ChunkHeader | None]:
    """Blocking: read each key's payload into its destination; per key its header or None."""
    out: list[ChunkHeader | None] = []
    for fut in submit_store_chunks(io, store, keys, dests, token_ids):
        try:
            out.append(fut.result())
        except ReadError:
            out.append(None)
    return out


async def aread_store_chunks(io: ChunkIO, store: FileStore, keys: Sequence[str],
                             dests: Sequence[Any], token_ids: Sequence[Any] | None = None,
                             ) -> list[ChunkHeader | None]:
    """The awaitable `read_store_chunks`: all keys in flight at once (up to max_in_flight)."""
    futures = [asyncio.wrap_future(f) for f in submit_store_chunks(io, store, keys, dests, token_ids)]
    results = await asyncio.gather(*futures, return_exceptions=True)
    out: list[ChunkHeader | None] = []
    for r in results:
        if isinstance(r, ReadError):
            out.append(None)
        elif isinstance(r, BaseException):
            raise r
        else:
            out.append(r)
    return out

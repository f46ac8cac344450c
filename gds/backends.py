"""The four ways a payload range reaches its destination, each a blocking `read` per request.

Threading: `read` runs on a request thread of ChunkIO and may fan pieces out to the shared
I/O pool (`pool`), waiting for all of them before it returns or raises, so no piece ever
writes into a destination after its request has finished. Pieces are `piece_bytes` long
(a multiple of 4 KiB) and start at aligned offsets when the range does.

- HostBackend (path 4): CPU destinations; `preadv` straight into the tensor's memory.
- BounceBackend (path 3): CUDA destinations; pieces land in pinned slots, then
  `copy_(non_blocking=True)` on a per-thread side stream. Two slots per I/O thread, so the
  copy of one piece overlaps the read of the next (double buffering).
- TorchGdsBackend (path 1) and KvikioBackend (path 2): cuFile DMA from the file into device
  memory; the bytes never touch host memory.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait
from typing import Any

import xxhash

from gds.buffers import ALIGN, aligned_empty
from gds.errors import IO, SHORT, ReadError
from gds.hostio import OpenFile, read_error, read_range
from gds.streams import SideStreams

# Below this a split costs more than it saves: a thread hand-off took 20-150 us on this
# shared 2-core VM, about what copying 1 MiB out of the page cache takes.
MAX_HOST_PIECE = 16 << 20
MIN_PIECE = 1 << 20


def spans(length: int, piece_bytes: int) -> list[tuple[int, int]]:
    return [(a, min(a + piece_bytes, length)) for a in range(0, length, piece_bytes)] or [(0, 0)]


def run_pieces(pool: Executor, work: Callable[[int, int], Any], length: int, piece_bytes: int,
               in_order: Callable[[int, int, Any], None] | None = None) -> None:
    """Run `work(a, b)` for every piece: the first on this thread, the rest offered to
    `pool`; then `in_order(a, b, result)` for each, in file order, on this thread (so a
    streaming hash overlaps the reads still running).

    A piece no pool thread has started by the time this thread gets to it is taken back and
    run here: on a busy host a woken pool thread can wait milliseconds for a CPU, and this
    thread, already running, should not sit idle behind it."""
    (a0, b0), *rest = spans(length, piece_bytes)
    futures: list[Future] = [pool.submit(work, a, b) for a, b in rest]
    try:
        result = work(a0, b0)
        if in_order:
            in_order(a0, b0, result)
        for (a, b), fut in zip(rest, futures, strict=True):
            result = work(a, b) if fut.cancel() else fut.result()
            if in_order:
                in_order(a, b, result)
    finally:
        # Not those taken back: a cancelled future counts as done only once a pool thread
        # has dequeued it, i.e. after the busy thread this one went past.
        wait([f for f in futures if not f.cancelled()])


class HostBackend:
    """Path 4: read into host memory in place (CPU tensors, numpy arrays, pinned buffers)."""

    name = "host"

    def __init__(self, pool: Executor, piece_bytes: int, mode: str, threads: int):
        self.pool, self.piece_bytes, self.mode, self.threads = pool, piece_bytes, mode, threads
        self._active = 0  # host reads running now, on any request thread
        self._lock = threading.Lock()

    def piece_for(self, length: int, active: int = 1) -> int:
        """The I/O threads shared among the `active` reads, one piece per share (the
        caller's thread included) up to MAX_HOST_PIECE, never under MIN_PIECE, where a
        hand-off costs more than it saves. Host reads are copies from the page cache: every
        extra piece is one more hand-off and no more bandwidth (16 MiB in 2 x 8 MiB ran
        1.2x faster than in 4 x 4 MiB on the README's VM), and once as many reads run as
        there are threads, splitting them only adds hand-offs: each reads whole."""
        share = max(1, self.threads // max(active, 1))
        even = -(-length // share)
        cap = max(self.piece_bytes, MAX_HOST_PIECE) if share > 1 else max(length, ALIGN)
        return min(cap, max(MIN_PIECE, -(-even // ALIGN) * ALIGN))

    def read(self, f: OpenFile, offset: int, view: memoryview,
             hasher: xxhash.xxh3_64 | None = None) -> int:
        """Fill `view` -> how many of its bytes came by O_DIRECT."""
        direct = 0

        def work(a: int, b: int) -> int:
            return read_range(f, view[a:b], offset + a, self.mode)

        def finished(a: int, b: int, direct_bytes: int) -> None:
            nonlocal direct
            direct += direct_bytes
            if hasher:
                hasher.update(view[a:b])

        with self._lock:
            self._active += 1
            active = self._active
        try:
            run_pieces(self.pool, work, view.nbytes, self.piece_for(view.nbytes, active), finished)
        finally:
            with self._lock:
                self._active -= 1
        return direct


class Slot:
    def __init__(self, tensor: Any):
        self.tensor = tensor
        self.view = memoryview(tensor.numpy())
        self.event: Any = None


class BounceSlots:
    """Host buffers of one piece each, pinned under CUDA; a slot is reused only once the
    copy that last read it has finished."""

    def __init__(self, count: int, size: int, pinned: bool):
        self.size = size
        self._free: queue.SimpleQueue[Slot] = queue.SimpleQueue()
        for _ in range(count):
            self._free.put(Slot(aligned_empty(size, pin_memory=pinned)))

    def acquire(self) -> Slot:
        slot = self._free.get()
        if slot.event is not None:
            slot.event.synchronize()
            slot.event = None
        return slot

    def release(self, slot: Slot) -> None:
        self._free.put(slot)

    def device_xxh3(self, dest: Any) -> int:
        """xxh3-64 of device bytes, read back through one slot (the cost of full verification
        when the payload never passed through host memory)."""
        hasher = xxhash.xxh3_64()
        slot = self.acquire()
        try:
            for a, b in spans(dest.numel(), self.size):
                slot.tensor[: b - a].copy_(dest[a:b])
                hasher.update(slot.view[: b - a])
        finally:
            self.release(slot)
        return hasher.intdigest()


class BounceBackend:
    """Path 3: file -> slot (preadv on the I/O pool) -> destination (async copy, side stream).

    Without CUDA the same pipeline runs with plain host slots and synchronous copies, which
    is how its logic is tested on CPU-only machines.
    """

    name = "bounce"

    def __init__(self, pool: Executor, piece_bytes: int, mode: str, slots: BounceSlots):
        self.pool, self.piece_bytes, self.mode, self.slots = pool, piece_bytes, mode, slots
        self._streams = SideStreams()

    def _copy(self, dest: Any, src: Any, ready: Any) -> Any:
        if dest.device.type != "cuda":
            dest.copy_(src)
            return None
        return self._streams.start(dest.device, ready, lambda: dest.copy_(src, non_blocking=True))

    def read(self, f: OpenFile, offset: int, dest: Any, ready: Any = None) -> None:
        def work(a: int, b: int) -> Any:
            slot = self.slots.acquire()
            try:
                read_range(f, slot.view[: b - a], offset + a, self.mode)
                slot.event = event = self._copy(dest[a:b], slot.tensor[: b - a], ready)
            finally:
                self.slots.release(slot)
            return event

        def finished(a: int, b: int, event: Any) -> None:
            if event is not None:
                event.synchronize()

        run_pieces(self.pool, work, dest.numel(), self.piece_bytes, finished)


class TorchGdsBackend:
    """Path 1: cuFile through `torch.cuda.gds.GdsFile`; pieces are storage slices read in
    parallel through one registered handle (cuFile handles are thread-safe)."""

    name = "torch-gds"

    def __init__(self, pool: Executor, piece_bytes: int):
        self.pool, self.piece_bytes = pool, piece_bytes

    def read(self, f: OpenFile, offset: int, dest: Any, ready: Any = None) -> None:
        import torch

        if ready is not None:
            ready.synchronize()  # cuFile DMA ignores streams: the destination must be idle
        try:
            gds_file = torch.cuda.gds.GdsFile(f.same_file(), os.O_RDONLY)
        except OSError as exc:
            raise read_error(f.path, exc) from exc  # say, evicted since we opened it
        except RuntimeError as exc:
            raise ReadError(f.path, IO, f"cuFile handle: {exc}") from exc
        storage, base = dest.untyped_storage(), dest.storage_offset()

        def work(a: int, b: int) -> None:
            try:
                gds_file.load_storage(storage[base + a : base + b], offset + a)
            except RuntimeError as exc:
                raise ReadError(f.path, IO, f"cuFile read: {exc}") from exc

        # The handle is deregistered and its descriptor closed when gds_file is collected,
        # right after this returns (pieces hold no reference once run_pieces has waited).
        run_pieces(self.pool, work, dest.numel(), self.piece_bytes)
        # torch does not check cuFileRead's count: a file cut short in place under the read
        # would leave the destination's tail unwritten. Chunk files are never truncated in
        # place by the store, so this is a damaged filesystem or another writer.
        size = os.fstat(gds_file.fd).st_size
        if size < offset + dest.numel():
            raise ReadError(f.path, SHORT, f"file is {size} bytes, range ends at {offset + dest.numel()}")


class KvikioBackend:
    """Path 2: `kvikio.CuFile.pread`, which splits the range over KvikIO's own thread pool."""

    name = "kvikio"

    def __init__(self, threads: int):
        import kvikio.defaults

        try:
            kvikio.defaults.set("num_threads", threads)  # KvikIO's default pool is 1 thread
        except (AttributeError, TypeError):
            reset = getattr(kvikio.defaults, "num_threads_reset", None)  # older KvikIO releases
            if reset is not None:
                reset(threads)

    def read(self, f: OpenFile, offset: int, dest: Any, ready: Any = None) -> None:
        import kvikio

        if ready is not None:
            ready.synchronize()
        try:
            with kvikio.CuFile(f.same_file(), "r") as cf:
                got = cf.pread(dest, dest.numel(), offset).get()
        except (RuntimeError, OSError) as exc:
            raise ReadError(f.path, IO, f"KvikIO read: {exc}") from exc
        if got != dest.numel():
            raise ReadError(f.path, SHORT, f"KvikIO read {got} of {dest.numel()} bytes")

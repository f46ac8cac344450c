"""Staging memory for loads and saves: where it sits (`staging_tensor`) and pools that keep it.

Fresh host memory costs a page fault per 4 KiB page on first touch, which is slower than
reading a page-cached chunk (docs/benchmarks/2026-11-23-ttft-load.md), so every adapter keeps
the buffers it staged chunks in and reuses them (`BufferPool`), rather than allocating per
chunk or per page. A buffer a read may still be writing (a load cut short by its deadline)
is never given back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gds.buffers import aligned_empty


def staging_tensor(kind: str, shape: int | tuple[int, ...], device: torch.device) -> Any:
    """Uninitialised uint8 memory of `shape` for a load's staging of `kind`
    (`KVConnector.staging_kind`): "device" memory on `device`; "direct" 4 KiB-aligned
    host memory that O_DIRECT fills; "host" memory, pinned when `device` is a GPU."""
    if kind == "device":
        return torch.empty(shape, dtype=torch.uint8, device=device)
    if kind == "direct":
        return aligned_empty(shape)
    return torch.empty(shape, dtype=torch.uint8, pin_memory=device.type == "cuda")


class BufferPool:
    """Free buffers made by `make`, kept up to `keep` (a callable: the bound may grow, e.g.
    to the most one step used). `take` and `give` may run on any thread."""

    def __init__(self, make: Callable[[], Any], keep: int | Callable[[], int],
                 fits: Callable[[Any], bool] | None = None):
        self._make = make
        self._keep = keep if callable(keep) else (lambda: keep)
        self._fits = fits
        self._free: list[Any] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._free)

    def __iter__(self) -> Iterator[Any]:
        """The free buffers now (a snapshot)."""
        with self._lock:
            return iter(list(self._free))

    def take(self) -> Any:
        with self._lock:
            if self._free:
                return self._free.pop()
        return self._make()

    def give(self, buf: Any) -> None:
        """Keep `buf` for a later `take` (dropped past the bound, or if it does not fit)."""
        if self._fits is not None and not self._fits(buf):
            return
        with self._lock:
            if len(self._free) < self._keep():
                self._free.append(buf)

"""Destination and source memory: byte views of tensors and buffers, 4 KiB-aligned host memory.

O_DIRECT (and cuFile) need the buffer address, the file offset and the length aligned to
4 KiB; torch's CPU allocator only guarantees 64 bytes, so callers that want the direct path
allocate with `aligned_empty`. Nothing here imports torch at module level: a torch tensor is
recognised by its methods, and torch is imported only when one is handled.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from storage.buffers import host_buffer

ALIGN = 4096


def is_tensor(obj: Any) -> bool:
    return hasattr(obj, "data_ptr") and hasattr(obj, "untyped_storage")


def is_cuda(obj: Any) -> bool:
    return is_tensor(obj) and obj.device.type == "cuda"


def for_gpu(obj: Any) -> bool:
    """Whether `obj` is GPU memory or pinned host memory (a GPU engine's staging). Nothing
    is pinned before CUDA is initialized, and asking then could initialize it."""
    if not is_tensor(obj):
        return False
    if obj.device.type == "cuda":
        return True
    import torch

    return torch.cuda.is_initialized() and obj.is_pinned()


def byte_tensor(tensor: Any) -> Any:
    """A flat uint8 view of a contiguous tensor (same memory, any device)."""
    import torch

    if not tensor.is_contiguous():
        raise ValueError("destination and source tensors must be contiguous")
    return tensor.detach().reshape(-1).view(torch.uint8)


def host_view(obj: Any) -> memoryview:
    """A flat byte memoryview over a CPU tensor, numpy array, mmap or bytes-like, no copy."""
    if is_tensor(obj):
        if obj.device.type != "cpu":
            raise ValueError(f"not host memory: tensor on {obj.device}")
        return memoryview(byte_tensor(obj).numpy())
    return memoryview(obj).cast("B")


def nbytes(obj: Any) -> int:
    if is_tensor(obj):
        return obj.numel() * obj.element_size()
    return memoryview(obj).nbytes


def address(view: memoryview) -> int:
    """The address of a memoryview's first byte (read-only views included)."""
    if view.nbytes == 0:
        return 0
    return np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]


def aligned_buffer(size: int) -> memoryview:
    """Page-aligned anonymous host memory (zero-filled on first touch)."""
    return memoryview(mmap.mmap(-1, max(size, 1)))[:size]


def aligned_empty(shape: Any, dtype: Any = None, pin_memory: bool = False) -> Any:
    """A CPU tensor whose data starts on a 4 KiB boundary, so O_DIRECT can fill it; not
    pinned, it is huge-page host memory (`storage.buffers.host_buffer`)."""
    import torch

    dtype = dtype or torch.uint8
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    size = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    if not pin_memory and size:
        # 2 MiB-aligned and THP-advised (storage.buffers): copies into it run 2-3x faster
        # than into 4 KiB pages on a VM.
        return torch.frombuffer(host_buffer(size), dtype=torch.uint8).view(dtype).view(shape)
    raw = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip : skip + size].view(dtype).view(shape)

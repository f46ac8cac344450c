"""Moving chunk payloads between files and (GPU) tensors: GPUDirect Storage when present,
pinned bounce buffers otherwise, and in-place parallel reads for CPU tensors.

    from gds import ChunkIO, IOConfig
    io = ChunkIO(IOConfig(), probe_dir="/nvme/kv")       # probes once, picks backends
    header = io.submit_chunk(path, dest, key=key).result()  # or: await io.read_chunk(...)
    io.stats()["backends"]                               # {"cpu": "host", "cuda": "torch-gds"}

Nothing here imports torch at import time; see docs/gds.md.
"""

from gds.buffers import aligned_buffer, aligned_empty
from gds.chunkio import ChunkIO, IOConfig
from gds.errors import ChunkIOError, ReadError, WriteError
from gds.filestore import (
    aread_store_chunks,
    enable_direct_reads,
    read_store_chunks,
    submit_store_chunks,
)
from gds.probe import Capabilities, choose_cuda_backend, probe

__all__ = [
    "Capabilities",
    "ChunkIO",
    "ChunkIOError",
    "IOConfig",
    "ReadError",
    "WriteError",
    "aligned_buffer",
    "aligned_empty",
    "aread_store_chunks",
    "choose_cuda_backend",
    "enable_direct_reads",
    "probe",
    "read_store_chunks",
    "submit_store_chunks",
]

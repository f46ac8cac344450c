"""What this host can do for CUDA destinations, probed once at start-up, and the choice it implies.

Order of preference for CUDA destinations (the issue's 1-2-3):

1. "torch-gds": `torch.cuda.gds.GdsFile` (PyTorch >= 2.7) when CUDA and cuFile work: a real
   probe read through cuFile into device memory succeeds and returns the right bytes;
2. "kvikio": `kvikio.CuFile` when KvikIO is installed and the same probe read works;
3. "bounce": pinned host buffers filled by the I/O thread pool, copied on a side stream.

CPU destinations always take the host path ("host": preadv straight into the tensor).
`choose_cuda_backend` is a pure function of `Capabilities`, so tests inject capabilities to
cover machines they do not run on (no GPU here).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from dataclasses import dataclass, field

CUDA_BACKENDS = ("torch-gds", "kvikio", "bounce")
_PROBE_BYTES = 64 * 1024


@dataclass(frozen=True)
class Capabilities:
    cuda: bool = False
    torch_gds: bool = False
    kvikio: bool = False
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict:
        return {"cuda": self.cuda, "torch_gds": self.torch_gds, "kvikio": self.kvikio,
                "notes": list(self.notes)}


def choose_cuda_backend(caps: Capabilities, prefer: str = "auto") -> str | None:
    """The backend for CUDA destinations: None without CUDA; ValueError if `prefer` is unusable."""
    if prefer != "auto" and prefer not in CUDA_BACKENDS:
        raise ValueError(f"cuda_backend={prefer!r}: expected auto or one of {', '.join(CUDA_BACKENDS)}")
    if not caps.cuda:
        if prefer != "auto":
            raise ValueError(f"cuda_backend={prefer!r} requested but CUDA is not available")
        return None
    usable = {"torch-gds": caps.torch_gds, "kvikio": caps.kvikio, "bounce": True}
    if prefer == "auto":
        return next(name for name in CUDA_BACKENDS if usable[name])
    if not usable[prefer]:
        why = "; ".join(caps.notes) or "its probe failed"
        raise ValueError(f"cuda_backend={prefer!r} requested but not usable here: {why}")
    return prefer


def _probe_file(directory: str) -> tuple[str, bytes]:
    data = os.urandom(_PROBE_BYTES)
    fd, path = tempfile.mkstemp(prefix=".kvstash-gds-probe.", dir=directory)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path, data


def _probe_torch_gds(path: str, data: bytes) -> None:
    import torch

    dest = torch.empty(len(data), dtype=torch.uint8, device="cuda")
    gds_file = torch.cuda.gds.GdsFile(path, os.O_RDONLY)
    gds_file.load_storage(dest.untyped_storage(), 0)
    del gds_file
    if bytes(dest.cpu().numpy()) != data:
        raise RuntimeError("cuFile read back different bytes")


def _probe_kvikio(path: str, data: bytes) -> None:
    import kvikio
    import torch

    dest = torch.empty(len(data), dtype=torch.uint8, device="cuda")
    with kvikio.CuFile(path, "r") as f:
        f.pread(dest, len(data), 0).get()
    if bytes(dest.cpu().numpy()) != data:
        raise RuntimeError("KvikIO read back different bytes")


def probe(directory: str | None = None) -> Capabilities:
    """Probe CUDA, cuFile (via torch) and KvikIO with one real read from a file in `directory`.

    Probe with the directory chunks live in: cuFile needs O_DIRECT, which a temp directory
    on tmpfs may refuse while the chunk store's NVMe or NFS mount takes it.
    """
    notes: list[str] = []
    try:
        import torch
    except ImportError:
        return Capabilities(notes=("torch is not installed",))
    if not torch.cuda.is_available():
        return Capabilities(notes=("no CUDA device",))
    path, data = _probe_file(directory or tempfile.gettempdir())
    usable = {}
    try:
        for name, check, present in (
            ("torch-gds", _probe_torch_gds, hasattr(torch.cuda, "gds")),
            ("kvikio", _probe_kvikio, importlib.util.find_spec("kvikio") is not None),
        ):
            usable[name] = False
            if not present:
                notes.append(f"{name}: not installed")
                continue
            try:
                check(path, data)
                usable[name] = True
            except Exception as exc:  # any failure means "not usable here", with the reason
                notes.append(f"{name}: {type(exc).__name__}: {exc}")
    finally:
        os.unlink(path)
    return Capabilities(True, usable["torch-gds"], usable["kvikio"], tuple(notes))

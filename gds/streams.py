"""Side streams for copies that must not queue behind the engine's work: one CUDA stream
per thread and device, used by the bounce buffers (gds.backends) and by the vLLM
connector's placement of chunks (connector.vllm_v1). Imports torch only when used."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class SideStreams:
    """A CUDA stream per calling thread and device."""

    def __init__(self) -> None:
        self._local = threading.local()

    def stream(self, device: Any) -> Any:
        import torch

        streams = self._local.__dict__.setdefault("streams", {})
        if device not in streams:
            streams[device] = torch.cuda.Stream(device=device)
        return streams[device]

    def start(self, device: Any, after: Any, work: Callable[[], None]) -> Any:
        """Queue `work`'s CUDA operations on this thread's stream for `device`, after the
        event `after` (None: at once); returns the event that marks them done."""
        import torch

        stream = self.stream(device)
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            work()
            done = torch.cuda.Event()
            done.record(stream)
        return done

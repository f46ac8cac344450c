"""`InFlightLoads`: the chunks loads are bringing in, so that no other request reads them again.

N requests of one stored prompt at once (a burst behind one system prompt) would each
read every chunk from the store. The first request's load claims its chunks; another
request whose next chunk is claimed waits for that load instead (the engine's own prefix
cache holds the chunk once it ends), though never longer than `max_wait_s`. Saves are
de-duplicated in the core itself (`KVConnector.writing`).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable


class InFlightLoads:
    """Chunk ids (the engine's: vLLM's block hashes) -> the request loading them. Used
    from one thread (the engine's scheduler)."""

    def __init__(self, max_wait_s: float):
        self.max_wait_s = max_wait_s
        self._by_chunk: dict[Hashable, tuple[str, float]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_chunk)

    def claim(self, owner: str, chunks: Iterable[Hashable]) -> None:
        """`owner`'s load brings these chunks in from now."""
        now = time.monotonic()
        self._by_chunk.update((c, (owner, now)) for c in chunks)

    def loaded_by_another(self, chunk: Hashable, asker: str) -> bool:
        """Whether another request's load, started less than `max_wait_s` ago, brings in
        `chunk`."""
        other = self._by_chunk.get(chunk)
        return (other is not None and other[0] != asker
                and time.monotonic() - other[1] < self.max_wait_s)

    def release(self, owner: str, chunks: Iterable[Hashable]) -> None:
        """`owner`'s load has ended (or its request has): its claims go."""
        for c in chunks:
            if self._by_chunk.get(c, ("",))[0] == owner:
                del self._by_chunk[c]

"""`GET /v1/keys`: a store's keys as text lines, pulled from its listing only as fast as
the client takes them, by a bounded number of listings at once.

A listing can be long (millions of keys on a shared directory), so it is never gathered:
the store's `list_keys` is an async iterator (a file store walks its directories a batch
at a time), the route turns each `LINES_PER_PIECE` keys into one body piece, and the next
piece is asked for only once the transport has taken the last one (uvicorn's flow
control; a client that takes nothing for `--send-timeout` is dropped). What one listing
holds is thus one piece and the store's walk state, and `listing_slots` bounds how many
run: `--max-tenant-listings` per tenant and `--max-listings` per process, beyond which a
listing is refused with 429 before the store is touched.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from kvserver.slots import Slot, Slots

# ~50 KiB of key lines a piece: large enough that writes are not per key.
LINES_PER_PIECE = 1024


def listing_slots(per_tenant: int, total: int, tenants: bool) -> Slots:
    """The places for listings (without tenants every client is one scope: only `total`)."""
    return Slots(per_tenant if tenants else total, total, "listings running",
                 "--max-tenant-listings", "--max-listings")


async def key_lines(keys: AsyncIterator[str], slot: Slot) -> AsyncIterator[bytes]:
    """`keys`, one per line, in pieces of LINES_PER_PIECE lines; `slot` is given back and
    the store's listing closed when the body ends, or when the client goes away."""
    try:
        piece: list[str] = []
        async for key in keys:
            piece.append(key)
            if len(piece) == LINES_PER_PIECE:
                yield ("\n".join(piece) + "\n").encode()
                piece = []
        if piece:
            yield ("\n".join(piece) + "\n").encode()
    finally:
        slot.release()
        close = getattr(keys, "aclose", None)
        if close is not None:
            await close()

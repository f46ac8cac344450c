"""Small request traces in the Mooncake format, generated here (the suite never needs ../shared)."""

from __future__ import annotations

import json
import random
from pathlib import Path

BLOCK = 512


def generate_trace(
    seed: int = 0, conversations: int = 12, rounds: int = 5, one_offs: int = 30
) -> list[dict]:
    """Chat sessions sharing one system-prompt block, interleaved with one-off documents.

    Each round of a session resends the session's history: every full block of the
    previous prompt (the partial last block changes as the text grows), then new blocks.
    Block ids are chained as in the real trace: an id is only ever reused at the same
    position after the same prefix.
    """
    rng = random.Random(seed)
    next_id = 1  # id 0 is the shared system-prompt block

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    events: list[list[int]] = []
    histories = {c: [0] for c in range(conversations)}
    pending = [c for c in range(conversations) for _ in range(rounds)]
    rng.shuffle(pending)
    scans = sorted(rng.sample(range(len(pending) + one_offs), one_offs))
    for slot in range(len(pending) + one_offs):
        if scans and scans[0] == slot:
            scans.pop(0)
            events.append(fresh(rng.randint(3, 12)))  # a long document, seen once
            continue
        c = pending.pop()
        ids = histories[c] + fresh(rng.randint(1, 4))
        histories[c] = ids[:-1] if len(ids) > 1 else ids
        events.append(ids)
    return [
        {"timestamp": 10 * i, "input_length": len(ids) * BLOCK - rng.randint(0, BLOCK - 1),
         "output_length": 16, "hash_ids": ids}
        for i, ids in enumerate(events)
    ]


def write_trace(path: Path, requests: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return path


def reference_best_hits(requests: list[dict]) -> tuple[int, int]:
    """Hit blocks with unlimited capacity, counted without the code under test.

    A block of request i is reusable if its id first appeared in a request before i; the
    hit is the run of reusable blocks at the start of the request (prefix-contiguous).
    """
    first_seen: dict[int, int] = {}
    for i, r in enumerate(requests):
        for h in r["hash_ids"]:
            first_seen.setdefault(h, i)
    hits = 0
    for i, r in enumerate(requests):
        for h in r["hash_ids"]:
            if first_seen[h] >= i:
                break
            hits += 1
    return hits, sum(len(r["hash_ids"]) for r in requests)


def reference_lru_hits(requests: list[dict], capacity: int) -> int:
    """A plain-list LRU under the replay's rules: a request's hit is its resident prefix;
    then its blocks are used deepest first (root last, so the root is most recent) and
    each missing one is inserted, evicting from the cold end."""
    cache: list[int] = []  # coldest first
    hits = 0
    for r in requests:
        ids = r["hash_ids"]
        n = 0
        while n < len(ids) and ids[n] in cache:
            n += 1
        hits += n
        for h in reversed(ids):
            if h in cache:
                cache.remove(h)
            cache.append(h)
            while len(cache) > capacity:
                cache.pop(0)
    return hits

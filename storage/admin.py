"""`kvstash ls | stat | gc --store URL`: look into and trim any store.

These commands read stores that exist; they never create one. A file:// URL whose directory
does not exist, or memory:// alone (a new, empty store in this process), is refused with one
line before anything is opened.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from storage.base import Store
from storage.capabilities import SupportsGC, SupportsRootUsage
from storage.codec import decode_header
from storage.errors import ConfigError
from storage.options import StoreURL, format_size, parse_size
from storage.registry import open_store


def _add_store(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", action="append", required=True, metavar="URL",
                   help="store URL (repeat for tiers, fastest first)")


def open_existing(urls: Sequence[str]) -> Store:
    """Open the store(s) at `urls`, refusing any that would be created by opening it."""
    parsed = [StoreURL(url) for url in urls if "://" in url]  # open_store names the others
    if parsed and all(u.scheme == "memory" for u in parsed):
        raise ConfigError(f"{parsed[0].redacted()}: a memory:// store lives inside one process; "
                          "there is no store there to read")
    for u in parsed:
        if u.scheme in ("file", "fsspec+file") and u.path and u.netloc in ("", "localhost"):
            root = Path(u.path)
            if not root.is_dir():
                what = "is not a directory" if root.exists() else "does not exist"
                raise ConfigError(f"no store at {u.redacted()}: {root} {what}")
    return open_store(list(urls))


def add_ls_arguments(p: argparse.ArgumentParser) -> None:
    _add_store(p)
    p.add_argument("--limit", type=int, default=0, help="stop after N keys (0 = all)")


async def run_ls(args: argparse.Namespace) -> int:
    store = open_existing(args.store)
    try:
        n = 0
        async for key in store.list_keys():
            print(key)
            n += 1
            if args.limit and n >= args.limit:
                break
    finally:
        await store.close()
    return 0


def add_stat_arguments(p: argparse.ArgumentParser) -> None:
    _add_store(p)
    p.add_argument("key", nargs="?", help="show this chunk's header instead of store stats")
    p.add_argument("--json", action="store_true", help="print raw JSON (for tools)")


def _size(n: Any) -> str:
    return format_size(n) if isinstance(n, int) else "unknown"


def summary_lines(stats: dict[str, Any], listed: int | None = None, indent: str = "") -> list[str]:
    """A store's stats as a few lines for people: where, what it holds, how full it is."""
    lines = [f"{indent}store:     {stats.get('url', '?')} ({stats.get('backend', '?')})"]
    held = []
    if listed is not None:
        held.append(f"{listed} listed")
    if isinstance(stats.get("chunks"), int):
        held.append(f"{stats['chunks']} in this process's index")
    if held:
        lines.append(f"{indent}chunks:    {', '.join(held)}")
    if "used_bytes" in stats:
        cap = stats.get("capacity_bytes")
        used = f"{_size(stats['used_bytes'])} of {_size(cap)}" if cap else \
            f"{_size(stats['used_bytes'])} (no capacity bound)"
        if cap:
            used += f" ({100 * stats['used_bytes'] / cap:.1f} %)"
        lines.append(f"{indent}used:      {used}")
    for name in ("root", "bucket", "prefix", "endpoint"):
        if stats.get(name):
            lines.append(f"{indent}{name + ':':<10} {stats[name]}")
    whole = stats.get("whole_root")
    if whole:
        tenants = whole.get("tenants") or {}
        lines.append(f"{indent}whole root: {whole['chunks']} chunks, {_size(whole['used_bytes'])} "
                     f"({whole['used_bytes']} bytes), tenants: {len(tenants)}")
        for tenant, held in sorted(tenants.items()):
            lines.append(f"{indent}  {tenant}: {held['chunks']} chunks, {_size(held['used_bytes'])}")
    for i, tier in enumerate(stats.get("tiers") or []):
        lines.append(f"{indent}tier {i}:")
        lines.extend(summary_lines(tier, None, indent + "  "))
    return lines


async def run_stat(args: argparse.Namespace) -> int:
    store = open_existing(args.store)
    try:
        if args.key:
            blob = await store.get(args.key)
            if blob is None:
                print(f"{args.key}: not found (or failed verification)")
                return 1
            h = decode_header(blob, args.key)
            info = {
                "key": h.key, "tokens": len(h.token_ids), "payload_bytes": h.payload_len,
                "header_bytes": h.header_len, "checksum": f"{h.payload_checksum:016x}",
                "meta": h.meta,
            }
            if args.json:
                print(json.dumps(info, indent=2))
            else:
                print(f"key:       {h.key}\n"
                      f"tokens:    {len(h.token_ids)}\n"
                      f"payload:   {format_size(h.payload_len)} ({h.payload_len} bytes)\n"
                      f"header:    {h.header_len} bytes\n"
                      f"checksum:  xxh3-64 {h.payload_checksum:016x}\n"
                      f"meta:      {json.dumps(h.meta)}")
            return 0
        n = 0
        async for _ in store.list_keys():
            n += 1
        stats = store.stats()
        if isinstance(store, SupportsRootUsage):
            stats["whole_root"] = await asyncio.to_thread(store.root_usage)
        if args.json:
            used = format_size(stats.get("used_bytes", 0))
            print(json.dumps({**stats, "listed_chunks": n, "used": used}, indent=2, default=str))
        else:
            print("\n".join(summary_lines(stats, n)))
    finally:
        await store.close()
    return 0


def add_gc_arguments(p: argparse.ArgumentParser) -> None:
    _add_store(p)
    p.add_argument("--capacity", required=True, help="target size, e.g. 500GiB, 2TiB")


async def run_gc(args: argparse.Namespace) -> int:
    try:
        capacity = parse_size(args.capacity)
    except ValueError as exc:
        raise ConfigError(f"--capacity: {exc}") from exc
    store = open_existing(args.store)
    try:
        if not isinstance(store, SupportsGC):
            raise ConfigError(f"{store}: this store has no gc (capacity is managed in-process)")
        result = await store.gc(capacity)
    finally:
        await store.close()
    print(json.dumps(result))
    return 0

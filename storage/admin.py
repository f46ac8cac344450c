"""`kvstash ls | stat | gc --store URL`: look into and trim any store."""

from __future__ import annotations

import argparse
import json

from storage.codec import decode_header
from storage.errors import ConfigError
from storage.options import format_size, parse_size
from storage.registry import open_store


def _add_store(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", action="append", required=True, metavar="URL",
                   help="store URL (repeat for tiers, fastest first)")


def add_ls_arguments(p: argparse.ArgumentParser) -> None:
    _add_store(p)
    p.add_argument("--limit", type=int, default=0, help="stop after N keys (0 = all)")


async def run_ls(args: argparse.Namespace) -> int:
    store = open_store(args.store)
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


async def run_stat(args: argparse.Namespace) -> int:
    store = open_store(args.store)
    try:
        if args.key:
            blob = await store.get(args.key)
            if blob is None:
                print(f"{args.key}: not found (or failed verification)")
                return 1
            h = decode_header(blob, args.key)
            print(json.dumps({
                "key": h.key, "tokens": len(h.token_ids), "payload_bytes": h.payload_len,
                "header_bytes": h.header_len, "checksum": f"{h.payload_checksum:016x}",
                "meta": h.meta,
            }, indent=2))
            return 0
        n = 0
        async for _ in store.list_keys():
            n += 1
        stats = store.stats()
        used = format_size(stats.get("used_bytes", 0))
        print(json.dumps({**stats, "listed_chunks": n, "used": used}, indent=2, default=str))
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
        raise ConfigError(f"--capacity: {exc}") from None
    store = open_store(args.store)
    try:
        gc = getattr(store, "gc", None)
        if gc is None:
            raise ConfigError(f"{store}: this store has no gc (capacity is managed in-process)")
        result = await gc(capacity)
    finally:
        await store.close()
    print(json.dumps(result))
    return 0

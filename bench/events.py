"""`kvstash bench events`: what `/v1/events` subscribers cost a kvserver's PUTs.

One `kvstash serve` on a fresh `file://` directory (a child process). First `--fill` PUTs
put that many events in its ring (a long-running server's ring is full: 65536 by
default). Then two timed rounds of `--puts` PUTs each, `--concurrency` at a time, of
`--payload-bytes` chunks: the baseline with no subscriber, then with `--subscribers`
streams of `GET /v1/events` open, each reading every event. Printed: PUTs per second of
each round and their ratio, and whether every subscriber got an event for every PUT of its
round. The client, its subscribers and the server share this machine's cores, so the
ratio also holds the subscribers' own reading. The server allows `--subscribers` streams
(`--events-max-streams`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from typing import Any

import httpx

from bench.demo import DemoServer
from bench.report import table, write_json
from bench.store import make_chunks

OCTETS = {"content-type": "application/octet-stream"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fill", type=int, default=30000,
                   help="PUTs before the timed rounds, their events left in the ring (default 30000)")
    p.add_argument("--puts", type=int, default=1000, help="PUTs in each timed round (default 1000)")
    p.add_argument("--subscribers", type=int, default=20,
                   help="event streams open in the second round (default 20)")
    p.add_argument("--concurrency", type=int, default=16, help="PUTs in flight (default 16)")
    p.add_argument("--payload-bytes", type=int, default=256, help="chunk payload size (default 256)")
    p.add_argument("--json", metavar="PATH", help="write the results here")


async def _put_all(client: httpx.AsyncClient, url: str, chunks: list[tuple[str, bytes]],
                   concurrency: int) -> float:
    """Seconds to PUT every chunk, `concurrency` at a time; each must be created (201)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(key: str, blob: bytes) -> None:
        async with gate:
            r = await client.put(f"{url}/v1/chunks/{key}", content=blob, headers=OCTETS)
            if r.status_code != 201:
                raise RuntimeError(f"PUT {key}: {r.status_code} {r.text[:200]}")

    t0 = time.perf_counter()
    await asyncio.gather(*(one(k, b) for k, b in chunks))
    return time.perf_counter() - t0


async def _subscribe(client: httpx.AsyncClient, url: str, keys: set[str], seen: set[str],
                     ready: asyncio.Event) -> None:
    """Follow `/v1/events` until it has shown a "stored" event for each of `keys`."""
    async with client.stream("GET", f"{url}/v1/events") as resp:
        async for line in resp.aiter_lines():
            msg = json.loads(line)
            if "since" in msg:
                ready.set()
            elif msg.get("event") == "stored" and msg["key"] in keys:
                seen.add(msg["key"])
                if len(seen) == len(keys):
                    return


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    n = args.fill + 2 * args.puts
    chunks = make_chunks(args.payload_bytes, n, tag=f"events-{time.time_ns()}")
    fill, base, timed = chunks[:args.fill], chunks[args.fill:-args.puts], chunks[-args.puts:]
    limits = httpx.Limits(max_connections=args.concurrency + args.subscribers + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits, trust_env=False) as client:
        await _put_all(client, url, fill, args.concurrency)
        base_s = await _put_all(client, url, base, args.concurrency)
        keys = {k for k, _ in timed}
        seen: list[set[str]] = [set() for _ in range(args.subscribers)]
        ready = [asyncio.Event() for _ in range(args.subscribers)]
        subs = [asyncio.create_task(_subscribe(client, url, keys, s, r))
                for s, r in zip(seen, ready, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in ready)), 60)
        with_s = await _put_all(client, url, timed, args.concurrency)
        try:
            await asyncio.wait_for(asyncio.gather(*subs), 60)  # every event delivered
        except TimeoutError:
            for t in subs:
                t.cancel()
    return {
        "fill": args.fill, "puts": args.puts, "subscribers": args.subscribers,
        "concurrency": args.concurrency, "payload_bytes": args.payload_bytes,
        "puts_per_s_no_subscribers": args.puts / base_s,
        "puts_per_s_with_subscribers": args.puts / with_s,
        "ratio": base_s / with_s,
        "every_event_delivered": all(len(s) == len(keys) for s in seen),
    }


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvstash-bench-events-") as root:
        server = DemoServer([f"file://{root}/store"],
                            ("--events-max-streams", str(max(args.subscribers, 1))))
        try:
            server.wait_ready()
            result = asyncio.run(measure(server.url, args))
        finally:
            server.stop()
    print(table(
        ["round", "PUTs/s", "vs no subscriber"],
        [["no subscriber (baseline)", result["puts_per_s_no_subscribers"], 1.0],
         [f"{args.subscribers} subscribers, {args.fill} events in the ring",
          result["puts_per_s_with_subscribers"], result["ratio"]]]))
    print(f"every subscriber got every event: {result['every_event_delivered']}")
    write_json(args.json, result)
    return 0 if result["every_event_delivered"] else 1

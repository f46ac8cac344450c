"""The compose check's client: saves and loads chunks through two kvserver replicas, restarts
one of them under load, then checks that every acknowledged chunk is there and right.

Run by scripts/compose-check.sh (with the project's virtualenv) against the stack of
deploy/compose-check.yml; prints one JSON object of figures and exits 1 if any chunk was
lost or wrong. The replicas stand behind no load balancer here, so the client is its own:
a request that fails on one replica is sent to the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import httpx

from hashing import Namespace, chunk_keys
from storage.codec import encode_chunk

READY_WAIT_S = 120.0


@dataclass
class Figures:
    replicas: int = 2
    requests: int = 0
    failovers: int = 0  # requests that failed on one replica and were sent to the other
    saved: int = 0  # chunks acknowledged (created or already there)
    cross_loads: int = 0  # loads answered by the replica that did not store the chunk
    restarts: int = 0
    lost: int = 0
    wrong: int = 0
    phases: dict = field(default_factory=dict)
    tiers: dict = field(default_factory=dict)  # replica -> its tiers, from /status.json


class Replicas:
    def __init__(self, urls: list[str], token: str, figures: Figures):
        self.clients = [httpx.AsyncClient(base_url=u, timeout=10.0,
                                          headers={"authorization": f"Bearer {token}"})
                        for u in urls]
        self.f = figures

    async def put(self, first: int, key: str, blob: bytes) -> int | None:
        """The replica that acknowledged the chunk, or None."""
        for i in (first, 1 - first):
            self.f.requests += 1
            try:
                r = await self.clients[i].put(f"/v1/chunks/{key}", content=blob,
                                              headers={"content-type": "application/octet-stream"})
                if r.status_code in (200, 201):
                    return i
            except httpx.HTTPError:
                pass
            self.f.failovers += 1
        return None

    async def get(self, first: int, key: str) -> tuple[int, bytes | None]:
        for i in (first, 1 - first):
            self.f.requests += 1
            try:
                r = await self.clients[i].get(f"/v1/chunks/{key}")
                if r.status_code == 200:
                    return i, r.content
                if r.status_code == 404:
                    return i, None
            except httpx.HTTPError:
                pass
            self.f.failovers += 1
        return -1, None

    async def close(self) -> None:
        for c in self.clients:
            await c.aclose()


def make_chunk(ns: Namespace, prompt: int, size: int) -> tuple[str, bytes]:
    tokens = [(prompt * 131 + i) % 50000 for i in range(ns.chunk_tokens)]
    (key,) = chunk_keys(tokens, ns)
    return key, encode_chunk(key, tokens, os.urandom(size), {"prompt": prompt})


async def wait_ready(urls: list[str]) -> None:
    deadline = time.monotonic() + READY_WAIT_S
    async with httpx.AsyncClient(timeout=2.0) as c:
        for url in urls:
            while True:
                try:
                    if (await c.get(f"{url}/readyz")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"{url} not ready within {READY_WAIT_S:.0f}s")
                await asyncio.sleep(0.5)


async def main(args: argparse.Namespace) -> int:
    f = Figures()
    urls = [args.replica_1, args.replica_2]
    await wait_ready(urls)
    ns = Namespace(model="compose-check", dtype="uint8", layout="bytes", chunk_tokens=16,
                   salt=uuid.uuid4().hex)
    reps = Replicas(urls, args.token, f)
    expected: dict[str, bytes] = {}

    async def round_trip(n: int) -> None:
        key, blob = make_chunk(ns, n, args.chunk_bytes)
        writer = await reps.put(n % 2, key, blob)
        if writer is None:
            return
        expected[key] = blob
        f.saved += 1
        reader, got = await reps.get(1 - writer, key)
        if got is not None and got != blob:
            f.wrong += 1
        f.cross_loads += reader == 1 - writer and got == blob

    t0 = time.monotonic()
    for n in range(args.warmup):
        await round_trip(n)
    f.phases["warmup"] = {"chunks": args.warmup, "seconds": round(time.monotonic() - t0, 2)}

    # Under load: workers keep saving and loading while replica 2 restarts.
    restarted = threading.Event()

    def restart() -> None:
        time.sleep(args.restart_after)
        subprocess.run(args.restart_cmd, shell=True, check=True)
        f.restarts += 1
        restarted.set()

    counter = iter(range(args.warmup, 10**9))
    stop = asyncio.Event()

    async def worker() -> None:
        while not stop.is_set():
            await round_trip(next(counter))

    t1 = time.monotonic()
    restarter = threading.Thread(target=restart, daemon=True)
    restarter.start()
    workers = [asyncio.create_task(worker()) for _ in range(args.workers)]
    while not restarted.is_set() and time.monotonic() - t1 < args.max_seconds:
        await asyncio.sleep(0.2)
    await wait_ready(urls)
    await asyncio.sleep(args.after_restart)
    stop.set()
    await asyncio.gather(*workers)
    f.phases["under_load"] = {"chunks": f.saved - args.warmup,
                              "seconds": round(time.monotonic() - t1, 2)}

    # Every acknowledged chunk, from both replicas: present and byte-identical.
    t2 = time.monotonic()
    for key, blob in expected.items():
        answers = []
        for i in (0, 1):
            f.requests += 1
            r = await reps.clients[i].get(f"/v1/chunks/{key}")
            answers.append(r.content if r.status_code == 200 else None)
        if all(a is None for a in answers):
            f.lost += 1
        f.wrong += sum(a is not None and a != blob for a in answers)
    f.phases["verify"] = {"chunks": len(expected), "seconds": round(time.monotonic() - t2, 2)}
    await reps.close()
    # What each replica's status page says of its tiers (the S3 tier fills behind the file one).
    async with httpx.AsyncClient(timeout=10.0) as c:
        for url in urls:
            report = (await c.get(f"{url}/status.json", headers={
                "authorization": f"Bearer {args.admin_token}"})).json()
            f.tiers[url] = [{k: t[k] for k in ("backend", "chunks", "errors", "breaker")}
                            for t in report["tiers"]]
    print(json.dumps(f.__dict__, indent=2))
    return 1 if f.lost or f.wrong or not f.restarts else 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replica-1", required=True)
    p.add_argument("--replica-2", required=True)
    p.add_argument("--token", default="change-me-to-a-long-random-token")
    p.add_argument("--admin-token", default="change-me-admin-status-token")
    p.add_argument("--restart-cmd", required=True, help="shell command restarting replica 2")
    p.add_argument("--warmup", type=int, default=64, help="round trips before the restart")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--chunk-bytes", type=int, default=256 * 1024)
    p.add_argument("--restart-after", type=float, default=2.0)
    p.add_argument("--after-restart", type=float, default=3.0,
                   help="seconds of load after the restarted replica is ready again")
    p.add_argument("--max-seconds", type=float, default=120.0)
    return p.parse_args()


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))

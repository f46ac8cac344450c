"""A TCP proxy that makes a loopback S3 server behave like a remote one: latency + per-connection bandwidth.

Real S3 answers after tens of milliseconds and streams ~85-90 MB/s per connection (AWS
S3 performance guidelines), so clients win with concurrency; loopback has neither limit.
Every byte a client sends reaches the server `latency` later (so each request waits that
long for its first response byte), and each connection carries at most `bandwidth` bytes
per second in each direction. It shapes bytes only and knows nothing of HTTP.

Run it as a process so its CPU use does not share the measured client's GIL:
    python -m bench.s3shape --upstream 127.0.0.1:9000 --shape 30ms,90MBps
prints `listening <port>` once ready and serves until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

from storage.options import parse_seconds, parse_size

_READ = 256 * 1024
_PACE = 256 * 1024


def parse_shape(text: str) -> tuple[float, float]:
    """`"30ms,90MBps"` -> (0.03 s, 90e6 bytes/s); the `ps` (per second) suffix is optional."""
    try:
        latency, bandwidth = text.split(",")
        rate = bandwidth.strip()
        rate = rate[:-2] if rate.lower().endswith("ps") else rate
        return parse_seconds(latency), float(parse_size(rate))
    except ValueError:
        raise ValueError(f"bad --shape {text!r}: expected LATENCY,BANDWIDTH like 30ms,90MBps") from None


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay: float,
                rate: float) -> None:
    """Forward src to dst, each byte `delay` after it arrived, at most `rate` bytes/s."""
    queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

    async def read() -> None:
        try:
            while data := await src.read(_READ):
                queue.put_nowait((time.monotonic(), data))
        finally:
            queue.put_nowait(None)

    reader = asyncio.ensure_future(read())
    try:
        next_free = 0.0
        while (item := await queue.get()) is not None:
            arrived, data = item
            wait = arrived + delay - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            for i in range(0, len(data), _PACE):
                piece = data[i : i + _PACE]
                dst.write(piece)
                await dst.drain()
                now = time.monotonic()
                next_free = max(now, next_free) + len(piece) / rate
                if next_free > now:
                    await asyncio.sleep(next_free - now)
    finally:
        reader.cancel()
        with contextlib.suppress(Exception):
            dst.write_eof()


async def serve(upstream: tuple[str, int], latency: float, rate: float, port: int = 0) -> None:
    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(*upstream)
        except OSError:
            cw.close()
            return
        try:
            await asyncio.gather(_pipe(cr, uw, latency, rate), _pipe(ur, cw, 0.0, rate))
        except (ConnectionError, OSError):
            pass
        finally:
            uw.close()
            cw.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    print(f"listening {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--upstream", required=True, help="HOST:PORT of the S3 server")
    p.add_argument("--shape", required=True, help="LATENCY,BANDWIDTH per connection, e.g. 30ms,90MBps")
    p.add_argument("--port", type=int, default=0, help="port to listen on (default: any free)")
    args = p.parse_args()
    host, _, port = args.upstream.rpartition(":")
    latency, rate = parse_shape(args.shape)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve((host, int(port)), latency, rate, args.port))


if __name__ == "__main__":
    main()

"""A TCP proxy that makes a loopback S3 server behave like a remote one: latency + per-connection bandwidth.

Real S3 answers after tens of milliseconds and streams ~85-90 MB/s per connection (AWS
S3 performance guidelines), so clients win with concurrency; loopback has neither limit.
Each burst of bytes a client sends (a request) reaches the server `latency` later, so
every request waits that long for its first response byte; each connection carries at
most `bandwidth` bytes per second in each direction. It shapes bytes and knows nothing
of HTTP. Two blocking threads per connection move 1 MiB at a time with `recv_into` /
`sendall` (the copies happen outside the GIL), so the proxy itself is not the bottleneck
on a small machine.

Run it as a process so that it does not share the measured client's GIL:
    python -m bench.s3shape --upstream 127.0.0.1:9000 --shape 30ms,90MBps
prints `listening <port>` once ready and serves until killed.
"""

from __future__ import annotations

import argparse
import contextlib
import select
import socket
import threading
import time

from storage.options import parse_seconds, parse_size

_CHUNK = 1024 * 1024


def parse_shape(text: str) -> tuple[float, float]:
    """`"30ms,90MBps"` -> (0.03 s, 90e6 bytes/s); the `ps` (per second) suffix is optional."""
    try:
        latency, bandwidth = text.split(",")
        rate = bandwidth.strip()
        rate = rate[:-2] if rate.lower().endswith("ps") else rate
        return parse_seconds(latency), float(parse_size(rate))
    except ValueError as exc:
        raise ValueError(f"bad --shape {text!r}: expected LATENCY,BANDWIDTH like 30ms,90MBps") from exc


def _pump(src: socket.socket, dst: socket.socket, delay: float, rate: float) -> None:
    """Copy src to dst: a burst that starts after src was idle waits `delay`; at most `rate` B/s."""
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    next_free = 0.0
    try:
        while True:
            idle = not select.select([src], [], [], 0)[0]
            n = src.recv_into(buf)
            if not n:
                break
            if idle and delay:
                time.sleep(delay)
            dst.sendall(view[:n])
            now = time.monotonic()
            next_free = max(now, next_free) + n / rate
            if next_free > now:
                time.sleep(next_free - now)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def _connection(client: socket.socket, upstream: tuple[str, int], delay: float, rate: float) -> None:
    try:
        server = socket.create_connection(upstream)
    except OSError:
        client.close()
        return
    for s in (client, server):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=_pump, args=(server, client, 0.0, rate), daemon=True)
    back.start()
    _pump(client, server, delay, rate)
    back.join()
    client.close()
    server.close()


def serve(upstream: tuple[str, int], latency: float, rate: float, port: int = 0) -> None:
    listener = socket.create_server(("127.0.0.1", port), backlog=128)
    print(f"listening {listener.getsockname()[1]}", flush=True)
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_connection, args=(client, upstream, latency, rate),
                         daemon=True).start()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--upstream", required=True, help="HOST:PORT of the S3 server")
    p.add_argument("--shape", required=True, help="LATENCY,BANDWIDTH per connection, e.g. 30ms,90MBps")
    p.add_argument("--port", type=int, default=0, help="port to listen on (default: any free)")
    args = p.parse_args()
    host, _, port = args.upstream.rpartition(":")
    latency, rate = parse_shape(args.shape)
    with contextlib.suppress(KeyboardInterrupt):
        serve((host, int(port)), latency, rate, args.port)


if __name__ == "__main__":
    main()

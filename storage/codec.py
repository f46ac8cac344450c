"""The chunk object format: a 4096-byte header, then the payload at offset 4096.

Header layout (little-endian):

    0   8s  magic b"KVSTASH\\0"
    8   H   format version: 1, or 2 for a chunk with segment checksums
    10  H   flags (0)
    12  I   header length: 4096, or a larger multiple of 4096 when the tokens and meta
            do not fit (so the payload stays 4 KiB-aligned for O_DIRECT and GDS)
    16  Q   payload length
    24  Q   xxh3-64 of the payload
    32  Q   xxh3-64 of the whole header with this field zeroed
    40  H   key length      42 H  reserved (0)
    44  I   token count     48 I  meta length
    52      key (ascii), token ids (uint32 LE), meta (JSON utf-8),
            version 2 only: segment count (uint32), then per segment its length and the
            xxh3-64 of its bytes (uint64 each), then zero padding

Every byte of the header is covered by the header checksum, and the payload by its own,
so any single corrupted byte is detected. Decoding never raises anything but ChunkError.
The meta is a layout's few fields: at most MAX_META_BYTES of JSON with at most
MAX_META_CONTAINERS objects and arrays, at encode and at decode, so that no header parses
into more than about a MiB of memory.

Segments (version 2). A payload that is layer-major (every layer's K/V one contiguous
byte range) may be saved with one checksum per segment, consecutive ranges that cover the
payload exactly. A reader can then fetch, verify and use one layer's range while the next
is in flight (`ChunkHeader.verify_segment`); the whole-payload checksum is still written
and still checked by every whole read. Version 1 chunks (no segments) decode as before;
readers older than version 2 refuse version 2 chunks, so upgrade readers before writers.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from hashing import is_valid_key, token_array

MAGIC = b"KVSTASH\x00"
VERSION = 1
VERSION_SEGMENTS = 2
# One checksum per (layer, KV head) of a large model's chunk (e.g. 126 layers x 16 heads):
# the table grows 16 bytes a segment, within MAX_HEADER_SIZE.
MAX_SEGMENTS = 8192
_SEGMENT = struct.Struct("<QQ")
ALIGN = 4096
HEADER_SIZE = 4096
_FIXED = struct.Struct("<8sHHIQQQHHII")
_HCHECK_OFFSET = 32
_NO_CHECKSUM = bytes(8)
_TOKEN_DTYPE = np.dtype("<u4")  # token ids as headers hold them
_META_CACHED_BYTES = 2048  # metas parsed once (`_meta`) are at most this long
MAX_HEADER_SIZE = 64 * ALIGN
# The largest chunk a store reads by default (its `max_chunk=`; kvserver's default
# --max-chunk-bytes): a larger object or file at a chunk's name is a miss, never read.
MAX_CHUNK = 1 << 30
# A meta describes a layout in a few fields. Parsed JSON costs up to ~24x its bytes (an
# empty object is 3 bytes and a 64-byte dict): these bound what one header may parse into
# (~1 MiB), whoever wrote it.
MAX_META_BYTES = 64 << 10
MAX_META_CONTAINERS = 1024
# What a parsed header may hold per byte of its meta, at most (the measured worst is ~24:
# empty objects), for caches that charge a header its cost (`ChunkHeader.cost`).
META_PARSED_PER_BYTE = 32


class ChunkError(ValueError):
    """Bytes that are not a valid chunk (or not the chunk that was asked for)."""


class TruncatedHeader(ChunkError):
    """The bytes given hold the start of a header longer than they are: a reader that gave
    only the usual 4 KiB reads `header_len` bytes (at most MAX_HEADER_SIZE) and decodes again."""

    def __init__(self, have: int, header_len: int):
        super().__init__(f"truncated header: {have} of {header_len} bytes")
        self.header_len = header_len


def _checksum(data: Any, length: int, what: str) -> int:
    """xxh3-64 of `data` (a buffer, or a list of buffers taken in order), which must be
    `length` bytes (ChunkError otherwise)."""
    parts = [memoryview(p).cast("B") for p in (data if isinstance(data, list) else [data])]
    nbytes = sum(p.nbytes for p in parts)
    if nbytes != length:
        raise ChunkError(f"{what} is {nbytes} bytes, header says {length}")
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0], seed=0)
    whole = xxhash.xxh3_64(seed=0)
    for p in parts:
        whole.update(p)
    return whole.intdigest()


@dataclass(frozen=True)
class ChunkHeader:
    key: str
    token_ids: np.ndarray
    meta: dict[str, Any]
    header_len: int
    payload_len: int
    payload_checksum: int
    segments: tuple[tuple[int, int, int], ...] = ()  # (offset, length, xxh3-64) per segment
    meta_len: int = 0  # bytes of the meta's JSON in the header

    @property
    def total_len(self) -> int:
        return self.header_len + self.payload_len

    @property
    def cost(self) -> int:
        """An upper bound of the memory this parsed header holds, in bytes."""
        return (512 + self.token_ids.nbytes + 96 * len(self.segments)
                + META_PARSED_PER_BYTE * self.meta_len)

    def verify_payload(self, payload: Any) -> None:
        """Raise ChunkError unless `payload` (a buffer, or a list of buffers that hold it
        in order) has this header's length and checksum."""
        self.verify_digest(_checksum(payload, self.payload_len, "payload"))

    def verify_digest(self, digest: int) -> None:
        """Raise ChunkError unless `digest` (the xxh3-64 of exactly `payload_len` payload
        bytes, hashed as they were read) is this header's payload checksum."""
        if digest != self.payload_checksum:
            raise ChunkError(f"payload checksum mismatch for {self.key}")

    def verify_contents(self, payload: Any) -> None:
        """Raise ChunkError unless `payload` (one buffer) matches every checksum this header
        carries: the whole payload's and each segment's, in one pass over the bytes. A
        writer's chunk is checked so before it is stored, so that whole readers and
        segment readers never disagree about one chunk."""
        view = memoryview(payload).cast("B")
        if not self.segments:
            self.verify_payload(view)
            return
        if view.nbytes != self.payload_len:
            raise ChunkError(f"payload is {view.nbytes} bytes, header says {self.payload_len}")
        whole = xxhash.xxh3_64(seed=0)
        for i, (offset, length, checksum) in enumerate(self.segments):
            part = view[offset : offset + length]
            whole.update(part)
            if xxhash.xxh3_64_intdigest(part, seed=0) != checksum:
                raise ChunkError(f"segment {i} checksum mismatch for {self.key}")
        if whole.intdigest() != self.payload_checksum:
            raise ChunkError(f"payload checksum mismatch for {self.key}")

    def verify_segment(self, i: int, data: Any) -> None:
        """Raise ChunkError unless `data` (a buffer, or a list of buffers that hold it in
        order) is segment i's bytes (its length and checksum)."""
        if not 0 <= i < len(self.segments):
            raise ChunkError(f"chunk {self.key} has no segment {i} ({len(self.segments)} segments)")
        _, length, checksum = self.segments[i]
        if _checksum(data, length, f"segment {i}") != checksum:
            raise ChunkError(f"segment {i} checksum mismatch for {self.key}")

    def span_segments(self, offset: int, length: int) -> range | None:
        """The segments that exactly cover payload bytes [offset, offset + length), or None
        where that range does not begin and end on segment boundaries (or there are no
        segments, or it is empty)."""
        if length <= 0 or not self.segments:
            return None
        starts = self._segment_starts
        first = starts.get(offset)
        last = starts.get(offset + length, len(self.segments) if offset + length
                          == self.payload_len else None)
        if first is None or last is None or last <= first:
            return None
        return range(first, last)

    @functools.cached_property
    def _segment_starts(self) -> dict[int, int]:
        return {off: i for i, (off, _, _) in enumerate(self.segments)}

    def aligned(self, spans: Any) -> bool:
        """Whether every (offset, length) of `spans` is a run of whole segments."""
        return all(self.span_segments(off, n) is not None for off, n in spans)

    def verify_span(self, offset: int, data: Any) -> None:
        """Raise ChunkError unless `data` (a buffer, or a list of buffers that hold it in
        order) is payload bytes [offset, offset + its length): a run of whole segments,
        each matching its own checksum. What a reader of part of a chunk (a rank's heads)
        checks: every segment it covers, and nothing it did not read."""
        parts = [memoryview(p).cast("B") for p in (data if isinstance(data, list) else [data])]
        if not self.span_intact(offset, parts):
            raise ChunkError(f"payload bytes at {offset} fail their segment checksums "
                             f"for {self.key}")

    def span_intact(self, offset: int, parts: list[memoryview]) -> bool:
        """Whether `parts` (byte views, in order) are payload bytes [offset, ...): a run of
        whole segments whose every checksum matches."""
        length = sum(p.nbytes for p in parts)
        covered = self.span_segments(offset, length)
        if covered is None:
            return False
        if len(parts) == 1:
            flat = parts[0]
            for s in covered:
                at, size, checksum = self.segments[s]
                at -= offset
                if xxhash.xxh3_64_intdigest(flat[at : at + size], seed=0) != checksum:
                    return False
            return True
        # Many views (e.g. a KV cache's blocks read into place, one per layer, head, K/V
        # and block): each segment hashed as a stream over the views it spans, with no
        # copy; a view inside what is left of a segment is hashed without being sliced.
        segments = iter(covered)
        _, need, checksum = self.segments[next(segments)]
        whole = xxhash.xxh3_64(seed=0)
        for view in parts:
            while True:
                n = view.nbytes
                if n < need:
                    whole.update(view)
                    need -= n
                    break
                whole.update(view[:need] if n > need else view)
                if whole.intdigest() != checksum:
                    return False
                view = view[need:]
                following = next(segments, None)
                if following is None:  # `length` is exactly the covered segments'
                    break
                _, need, checksum = self.segments[following]
                whole = xxhash.xxh3_64(seed=0)
                if not view.nbytes:
                    break
        return True

    def segment_intact(self, s: int, parts: list[memoryview]) -> bool:
        """Whether `parts` (byte views that hold segment s in order, their lengths already
        checked against it) hash to segment s's checksum: `verify_segment` less its checks,
        for a reader that made them once for every segment."""
        whole = xxhash.xxh3_64(seed=0)
        for p in parts:
            whole.update(p)
        return whole.intdigest() == self.segments[s][2]

    def matches_tokens(self, token_ids: Any) -> bool:
        if type(token_ids) is list:  # an engine's own list: compared as ints, no array built
            return self.token_ids.tolist() == token_ids
        if (isinstance(token_ids, np.ndarray) and token_ids.dtype == _TOKEN_DTYPE
                and token_ids.ndim == 1):  # the header's own form: compared as bytes
            return token_ids.tobytes() == self.token_ids.tobytes()
        return np.array_equal(self.token_ids, token_array(token_ids))


@dataclass(frozen=True)
class Chunk:
    header: ChunkHeader
    payload: memoryview

    @property
    def key(self) -> str:
        return self.header.key

    @property
    def token_ids(self) -> np.ndarray:
        return self.header.token_ids

    @property
    def meta(self) -> dict[str, Any]:
        return self.header.meta


def header_size_for(n_tokens: int, meta_len: int, key_len: int = 49, n_segments: int = 0) -> int:
    need = _FIXED.size + key_len + 4 * n_tokens + meta_len
    if n_segments:
        need += 4 + _SEGMENT.size * n_segments
    return max(HEADER_SIZE, -(-need // ALIGN) * ALIGN)


def _checksums(view: memoryview, segments: Any) -> tuple[int, list[tuple[int, int]]]:
    """(the payload's xxh3-64, [(length, xxh3-64)] per segment) in one pass over the bytes."""
    lengths = [int(n) for n in segments]
    if not lengths or len(lengths) > MAX_SEGMENTS or min(lengths) <= 0:
        raise ChunkError(f"segments must be 1 to {MAX_SEGMENTS} positive lengths")
    if sum(lengths) != view.nbytes:
        raise ChunkError(f"segments cover {sum(lengths)} bytes, the payload is {view.nbytes}")
    whole = xxhash.xxh3_64(seed=0)
    table, pos = [], 0
    for n in lengths:
        part = view[pos : pos + n]
        whole.update(part)
        table.append((n, xxhash.xxh3_64_intdigest(part, seed=0)))
        pos += n
    return whole.intdigest(), table


def encode_header(key: str, token_ids: Any, payload: Any, meta: dict | None = None, *,
                  segments: Any = None) -> bytes:
    """The header bytes for `payload` (the payload itself is not copied). `segments`: byte
    lengths of consecutive payload ranges, one checksum each (a version 2 header)."""
    if not is_valid_key(key):
        raise ChunkError(f"malformed key {key!r}")
    tokens = token_array(token_ids)
    view = memoryview(payload).cast("B")
    try:
        meta_bytes = json.dumps(meta or {}, sort_keys=True, separators=(",", ":")).encode()
    except RecursionError as exc:
        raise ChunkError("meta is nested too deeply") from exc
    _check_meta_size(meta_bytes)
    kb = key.encode("ascii")
    table: list[tuple[int, int]] = []  # (length, xxh3-64) per segment
    if segments is None:
        version, checksum = VERSION, xxhash.xxh3_64_intdigest(view, seed=0)
    else:
        version, (checksum, table) = VERSION_SEGMENTS, _checksums(view, segments)
    hlen = header_size_for(len(tokens), len(meta_bytes), len(kb), len(table))
    if hlen > MAX_HEADER_SIZE:
        raise ChunkError(f"header of {hlen} bytes exceeds {MAX_HEADER_SIZE}")
    buf = bytearray(hlen)
    _FIXED.pack_into(
        buf, 0, MAGIC, version, 0, hlen, view.nbytes, checksum,
        0, len(kb), 0, len(tokens), len(meta_bytes),
    )
    pos = _FIXED.size
    for part in (kb, tokens.tobytes(), meta_bytes):
        buf[pos : pos + len(part)] = part
        pos += len(part)
    if table:
        struct.pack_into("<I", buf, pos, len(table))
        pos += 4
        for entry in table:
            _SEGMENT.pack_into(buf, pos, *entry)
            pos += _SEGMENT.size
    struct.pack_into("<Q", buf, _HCHECK_OFFSET, xxhash.xxh3_64_intdigest(bytes(buf), seed=0))
    return bytes(buf)


def encode_chunk(key: str, token_ids: Any, payload: Any, meta: dict | None = None, *,
                 segments: Any = None) -> bytes:
    """Header + payload in one immutable blob; the payload starts at a 4 KiB boundary.
    `segments`: byte lengths of consecutive payload ranges (e.g. one per layer), each
    saved with its own checksum."""
    header = encode_header(key, token_ids, payload, meta, segments=segments)
    return header + memoryview(payload).cast("B")


def decode_header(data: Any, key: str | None = None) -> ChunkHeader:
    """Parse and verify a header from the first bytes of `data` (at least the header length)."""
    view = memoryview(data).cast("B")
    if view.nbytes < _FIXED.size:
        raise ChunkError(f"{view.nbytes} bytes is too short for a chunk header")
    try:
        (magic, version, flags, hlen, plen, pcheck, hcheck, klen, _res, ntok, mlen) = (
            _FIXED.unpack_from(view, 0)
        )
    except struct.error as exc:
        raise ChunkError(f"unreadable header: {exc}") from exc
    if magic != MAGIC:
        raise ChunkError("bad magic: not a kvstash chunk")
    if version not in (VERSION, VERSION_SEGMENTS):
        raise ChunkError(f"unsupported chunk format version {version}")
    if hlen < HEADER_SIZE or hlen % ALIGN or hlen > MAX_HEADER_SIZE:
        raise ChunkError(f"bad header length {hlen}")
    if view.nbytes < hlen:
        raise TruncatedHeader(view.nbytes, hlen)
    if _FIXED.size + klen + 4 * ntok + mlen > hlen:
        raise ChunkError("header fields overflow the header")
    whole = xxhash.xxh3_64(view[:_HCHECK_OFFSET], seed=0)  # the header, its checksum zeroed
    whole.update(_NO_CHECKSUM)
    whole.update(view[_HCHECK_OFFSET + 8 : hlen])
    if whole.intdigest() != hcheck:
        raise ChunkError("header checksum mismatch")
    pos = _FIXED.size
    try:
        got_key = bytes(view[pos : pos + klen]).decode("ascii")
        tokens = np.frombuffer(bytes(view[pos + klen : pos + klen + 4 * ntok]), dtype="<u4")
        meta = _meta(bytes(view[pos + klen + 4 * ntok : pos + klen + 4 * ntok + mlen]))
        segments = (_decode_segments(view, pos + klen + 4 * ntok + mlen, hlen, plen)
                    if version == VERSION_SEGMENTS else ())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ChunkError(f"unreadable header fields: {exc}") from exc
    except RecursionError as exc:
        # The header checksum covers the meta, so only a forged header gets here.
        raise ChunkError("unreadable header fields: meta is nested too deeply") from exc
    if flags != 0 or not isinstance(meta, dict):
        raise ChunkError("unsupported header flags or meta")
    if key is not None and got_key != key:
        raise ChunkError(f"chunk holds key {got_key!r}, expected {key!r}")
    return ChunkHeader(got_key, tokens, meta, hlen, plen, pcheck, segments, mlen)


def _check_meta_size(raw: bytes) -> None:
    """Refuse a meta whose parse could cost more than a layout's description needs: past
    MAX_META_BYTES, or with more than MAX_META_CONTAINERS objects and arrays (every `{`
    and `[` counted, inside strings too: an upper bound for the price of one scan)."""
    if len(raw) > MAX_META_BYTES:
        raise ChunkError(f"meta of {len(raw)} bytes exceeds {MAX_META_BYTES}")
    if raw.count(b"{") + raw.count(b"[") > MAX_META_CONTAINERS:
        raise ChunkError(f"meta holds more than {MAX_META_CONTAINERS} objects and arrays")


@functools.lru_cache(maxsize=64)
def _parsed_meta(raw: bytes) -> Any:
    return json.loads(raw)


def _meta(raw: bytes) -> Any:
    """A header's meta, parsed once per distinct bytes (the chunks of one layout share
    theirs): a shallow copy of the cached parse, so a caller that sets a key sets its own
    (readers only compare metas; none changes what is nested inside)."""
    _check_meta_size(raw)
    if len(raw) > _META_CACHED_BYTES:
        return json.loads(raw)
    meta = _parsed_meta(raw)
    return dict(meta) if isinstance(meta, dict) else meta


def _decode_segments(view: memoryview, pos: int, hlen: int,
                     plen: int) -> tuple[tuple[int, int, int], ...]:
    """The segment table at `pos` (inside a header whose checksum already held)."""
    if pos + 4 > hlen:
        raise ChunkError("segment table overflows the header")
    (n,) = struct.unpack_from("<I", view, pos)
    if not 0 < n <= MAX_SEGMENTS or pos + 4 + n * _SEGMENT.size > hlen:
        raise ChunkError(f"bad segment count {n}")
    out, offset = [], 0
    for i in range(n):
        length, checksum = _SEGMENT.unpack_from(view, pos + 4 + i * _SEGMENT.size)
        if length <= 0:
            raise ChunkError(f"segment {i} is empty")
        out.append((offset, length, checksum))
        offset += length
    if offset != plen:
        raise ChunkError(f"segments cover {offset} bytes, the payload is {plen}")
    return tuple(out)


def decode_chunk(blob: Any, key: str | None = None, token_ids: Any = None) -> Chunk:
    """Verify a whole blob (header, exact length, payload checksum; key and tokens if given)."""
    view = memoryview(blob).cast("B")
    header = decode_header(view, key)
    if view.nbytes != header.total_len:
        raise ChunkError(f"chunk is {view.nbytes} bytes, header says {header.total_len}")
    payload = view[header.header_len :]
    header.verify_payload(payload)
    if token_ids is not None and not header.matches_tokens(token_ids):
        raise ChunkError(f"chunk {header.key} holds other tokens than requested")
    return Chunk(header, payload)

"""`fsspec+<protocol>://path?opt=...` — chunks as files on any fsspec filesystem (gcs, az, sftp, ...).

For a URL the user already has: `fsspec+gcs://bucket/kv`, `fsspec+sftp://host/srv/kv?username=u`.
Query options other than the store's own (`publish`, `verify`) go to
`fsspec.filesystem(protocol, **options)` ("true"/"false" and integers are converted).
This backend is slower than the native ones (every call goes through fsspec's
synchronous API in a thread) and has no gc; use `s3://` or `file://` where they apply.

Layout: `<root>/<ns_id>/<digest>`, tenants under `<root>/tenants/<tenant>/`.

Publishing keeps the create-only, never-partial rules as far as the filesystem allows:
- `publish=create` (default for object stores: gcs, s3, az, memory, ...): one
  `pipe_file(mode="create")`, which those filesystems make atomic and conditional.
- `publish=rename` (default otherwise: sftp, ftp, smb, local, ...): write a hidden temp
  file next to the target, then `mv` it into place after checking the target is absent.
  A lost race overwrites identical bytes (keys are content-addressed); readers never see
  a partial chunk where the filesystem's rename is atomic.
Every get verifies the chunk; a corrupt file is deleted and counted as a miss.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from hashing import is_valid_key
from storage.base import PROBE_KEY, Store, check_blob, check_key, check_tenant
from storage.codec import ChunkError, decode_chunk
from storage.errors import ConfigError, StoreUnavailable
from storage.options import StoreURL, parse_bool

log = logging.getLogger("kvstash.storage.fsspec")

TENANTS = "tenants"
TMP_MARK = ".tmp."
# Filesystems whose single-object writes are atomic and whose pipe_file(mode="create")
# is conditional (or, for memory, checked under the GIL).
ATOMIC_CREATE = {"memory", "s3", "s3a", "gcs", "gs", "az", "abfs", "abfss", "adl", "oss"}


def _coerce(value: str) -> Any:
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(value)
    except ValueError:
        return value


class FsspecStore(Store):
    def __init__(self, fs: Any, root: str, url: str, *, publish: str, verify: bool = True):
        super().__init__()
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.publish = publish
        self.verify = verify

    @classmethod
    def from_url(cls, u: StoreURL) -> FsspecStore:
        import fsspec

        protocol = u.scheme.removeprefix("fsspec+")
        publish = u.take("publish", str, "create" if protocol in ATOMIC_CREATE else "rename")
        if publish not in ("create", "rename"):
            raise ConfigError(f"{u.redacted()}: publish={publish!r}: expected create or rename")
        verify = u.take("verify", parse_bool, True)
        names = [k for k, _ in parse_qsl(urlsplit(u.url).query, keep_blank_values=True)]
        options = {k: _coerce(u.take(k)) for k in names if k not in ("publish", "verify")}
        u.finish()
        try:
            fs = fsspec.filesystem(protocol, **options)
        except (ImportError, ValueError, TypeError) as exc:
            raise ConfigError(f"{u.redacted()}: cannot open fsspec protocol {protocol!r}: "
                              f"{exc}") from exc
        root = fs._strip_protocol(f"{protocol}://{u.netloc}{u.path}")
        return cls(fs, root, u.redacted(), publish=publish, verify=verify)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    # -- writes --------------------------------------------------------------------------

    def _put_sync(self, path: str, data: bytes) -> bool:
        if self.fs.exists(path):
            return False
        if self.publish == "create":
            try:
                self.fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                return False
            return True
        parent, _, name = path.rpartition("/")
        self.fs.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/.{name}{TMP_MARK}{secrets.token_hex(6)}"
        self.fs.pipe_file(tmp, data)
        try:
            if self.fs.exists(path):
                return False
            self.fs.mv(tmp, path)
            return True
        finally:
            if self.fs.exists(tmp):
                self.fs.rm(tmp)

    async def put(self, key: str, blob: Any) -> bool:
        check_blob(key, blob)
        data = blob if isinstance(blob, bytes) else bytes(blob)
        try:
            wrote = await self._call(self._put_sync, self._path(key), data)
        except Exception as exc:  # fsspec backends raise their own types: map them here
            self.counters["put_errors"] += 1
            raise StoreUnavailable(f"{self}: put {key} failed: {type(exc).__name__}: {exc}") from exc
        if wrote:
            self.counters["puts"] += 1
            self.counters["bytes_written"] += len(data)
        else:
            self.counters["put_skipped"] += 1
        return wrote

    # -- reads ---------------------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        check_key(key)
        self.counters["gets"] += 1
        path = self._path(key)
        try:
            blob = await self._call(self.fs.cat_file, path)
        except FileNotFoundError:
            blob = None
        except Exception as exc:
            self.counters["errors"] += 1
            log.debug("%s: get %s: %s", self, key, exc)
            blob = None
        if blob is not None:
            try:
                if self.verify:
                    decode_chunk(blob, key)
            except ChunkError as exc:
                self.counters["corrupt"] += 1
                log.warning("%s: deleting corrupt chunk %s: %s", self, key, exc)
                await self._remove_quietly(path)
                blob = None
        if blob is None:
            self.counters["misses"] += 1
            return None
        self.counters["hits"] += 1
        self.counters["bytes_read"] += len(blob)
        return blob

    async def _remove_quietly(self, path: str) -> None:
        try:
            await self._call(self.fs.rm, path)
        except Exception as exc:
            log.debug("%s: could not delete %s: %s", self, path, exc)

    async def _present(self, key: str) -> bool:
        try:
            return bool(await self._call(self.fs.exists, self._path(key)))
        except Exception:
            self.counters["errors"] += 1
            return False

    async def probe(self) -> str | None:
        try:
            await self._call(self.fs.exists, self._path(PROBE_KEY))
        except Exception as exc:
            self.counters["errors"] += 1
            return f"{self}: exists failed: {type(exc).__name__}: {exc}"
        return None

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        for k in keys:
            check_key(k)
        return list(await asyncio.gather(*(self._present(k) for k in keys)))

    async def prefix_len(self, keys: Sequence[str]) -> int:
        for k in keys:
            check_key(k)
        n = 0
        for k in keys:
            if not await self._present(k):
                break
            n += 1
        return n

    # -- admin ---------------------------------------------------------------------------

    async def delete(self, key: str) -> bool:
        check_key(key)
        path = self._path(key)
        try:
            if not await self._call(self.fs.exists, path):
                return False
            await self._call(self.fs.rm, path)
        except FileNotFoundError:
            return False
        except Exception as exc:
            raise StoreUnavailable(f"{self}: delete {key} failed: {exc}") from exc
        self.counters["deletes"] += 1
        return True

    async def list_keys(self) -> AsyncIterator[str]:
        try:
            paths = await self._call(self.fs.find, self.root)
        except FileNotFoundError:
            return
        except Exception as exc:
            raise StoreUnavailable(f"{self}: list failed: {exc}") from exc
        root = self.fs._strip_protocol(self.root).rstrip("/") + "/"
        for p in paths:
            rel = self.fs._strip_protocol(p)[len(root):]
            if is_valid_key(rel):
                yield rel

    def scoped(self, tenant: str) -> FsspecStore:
        check_tenant(tenant)
        return FsspecStore(self.fs, f"{self.root}/{TENANTS}/{tenant}", f"{self.url}#{tenant}",
                           publish=self.publish, verify=self.verify)

    def stats(self) -> dict[str, Any]:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return {**super().stats(), "backend": "fsspec", "protocol": protocol,
                "root": self.root, "publish": self.publish}

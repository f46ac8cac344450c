"""`open_store(url)` / `open_store([url, ...])`: URL scheme -> backend class, tiers from lists."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Protocol

from storage.base import Store
from storage.errors import ConfigError
from storage.options import StoreURL


class Backend(Protocol):
    """A backend class: opens its store from a parsed URL (one-line ConfigError if bad)."""

    def from_url(self, u: StoreURL) -> Store: ...


# scheme -> "module:Class"; each class has `from_url(StoreURL) -> Store`. Imported lazily so
# that a server with only file:// never imports aiobotocore, and the core never imports torch.
# An entry may also be a Backend itself (a test's throttled file store, say).
BACKENDS: dict[str, str | Backend] = {
    "memory": "storage.memory:MemoryStore",
    "file": "storage.file:FileStore",
    "s3": "storage.s3:S3Store",
    "http": "storage.http:HttpStore",
    "https": "storage.http:HttpStore",
}
# Any other scheme written as `fsspec+<protocol>://...` goes to the generic fsspec backend.
FSSPEC_PREFIX = "fsspec+"


def _backend_class(scheme: str) -> Backend:
    target = BACKENDS.get(scheme)
    if target is not None and not isinstance(target, str):
        return target
    if target is None and scheme.startswith(FSSPEC_PREFIX):
        target = "storage.fsspec_store:FsspecStore"
    if target is None:
        known = ", ".join(sorted(BACKENDS)) + ", fsspec+<protocol>"
        raise ConfigError(f"unknown store scheme {scheme!r} (known: {known})")
    module, _, name = target.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise ConfigError(f"store scheme {scheme!r} needs a missing package: {exc}") from exc


def open_store(url: str | Sequence[str]) -> Store:
    """Open one store from a URL, or tiers (fastest first) from a list of URLs."""
    if not isinstance(url, str):
        urls = list(url)
        if not urls:
            raise ConfigError("open_store: empty list of store URLs")
        if len(urls) == 1:
            return open_store(urls[0])
        from storage.tiered import TieredStore

        return TieredStore([open_store(u) for u in urls])
    if "://" not in url:
        raise ConfigError(f"store URL {url!r} has no scheme (try file:///path or memory://)")
    u = StoreURL(url)
    return _backend_class(u.scheme).from_url(u)

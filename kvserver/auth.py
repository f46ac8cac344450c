"""Bearer tokens -> tenants, loaded from a tokens file and compared in constant time.

Tokens file: one `TENANT TOKEN` pair per line; blank lines and lines starting with `#` are
ignored, and so is a trailing comment that is a separate word (`alice TOKEN  # rotated`); a
`#` inside a token is part of the token. Several tokens may share a tenant (rotation). A
token must be at least 16 characters. The tenant `*` marks an admin token: it reads the
status page (kvserver.status) for every tenant and has no key space of its own. The file
must be private to the server's user (no group or other permission bits), as it holds
every tenant's credentials.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from pathlib import Path

from storage.base import check_tenant
from storage.errors import ConfigError

MIN_TOKEN_CHARS = 16
# The tenant name of admin tokens in the tokens file (not a valid tenant name).
ADMIN = "*"


def _digest(token: str) -> bytes:
    # Comparing fixed-length digests keeps compare_digest from leaking the token's length.
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class TokenTable:
    """Which tenant a presented bearer token belongs to."""

    def __init__(self, pairs: list[tuple[str, str]]):
        if not pairs:
            raise ConfigError("tokens file holds no `TENANT TOKEN` lines")
        seen: set[bytes] = set()
        self._entries: list[tuple[bytes, str]] = []
        for tenant, token in pairs:
            try:
                if tenant != ADMIN:
                    check_tenant(tenant)
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc
            if len(token) < MIN_TOKEN_CHARS:
                raise ConfigError(f"token for tenant {tenant!r} is shorter than {MIN_TOKEN_CHARS} chars")
            d = _digest(token)
            if d in seen:
                raise ConfigError(f"a token for tenant {tenant!r} is listed twice")
            seen.add(d)
            self._entries.append((d, tenant))

    @classmethod
    def from_file(cls, path: str | Path) -> TokenTable:
        try:
            with open(path, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                raw = f.read()
        except OSError as exc:
            raise ConfigError(f"cannot read tokens file {path}: {exc.strerror}") from exc
        if mode & 0o077:
            raise ConfigError(
                f"tokens file {path} is open to group or others (mode "
                f"{stat.S_IMODE(mode):04o}): run `chmod 600 {path}`")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"tokens file {path} is not UTF-8 text") from exc
        pairs = []
        for n, line in enumerate(text.splitlines(), 1):
            parts = line.split()
            if not parts or parts[0].startswith("#"):
                continue
            if len(parts) > 2 and parts[2].startswith("#"):
                parts = parts[:2]
            if len(parts) != 2:
                raise ConfigError(f"{path}:{n}: expected `TENANT TOKEN` (a comment is a "
                                  "whole line or a separate word starting with `#`)")
            pairs.append((parts[0], parts[1]))
        return cls(pairs)

    @property
    def tenants(self) -> list[str]:
        """The tenants with a key space (admin tokens have none)."""
        return sorted({t for _, t in self._entries if t != ADMIN})

    def tenant_for(self, token: str) -> str | None:
        """The token's tenant (ADMIN for an admin token), or None. Every entry is compared, so time does not depend on
        which entry (if any) matches."""
        presented = _digest(token)
        found = None
        for digest, tenant in self._entries:
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found

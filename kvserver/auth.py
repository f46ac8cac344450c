"""Bearer tokens -> tenants, loaded from a tokens file and compared in constant time.

Tokens file: one `TENANT TOKEN` pair per line; blank lines and `#` comments are ignored.
Several tokens may share a tenant (rotation). A token must be at least 16 characters.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from storage.base import check_tenant
from storage.errors import ConfigError

MIN_TOKEN_CHARS = 16


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
                check_tenant(tenant)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
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
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read tokens file {path}: {exc.strerror}") from None
        pairs = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ConfigError(f"{path}:{n}: expected `TENANT TOKEN`")
            pairs.append((parts[0], parts[1]))
        return cls(pairs)

    @property
    def tenants(self) -> list[str]:
        return sorted({t for _, t in self._entries})

    def tenant_for(self, token: str) -> str | None:
        """The token's tenant, or None. Every entry is compared, so time does not depend on
        which entry (if any) matches."""
        presented = _digest(token)
        found = None
        for digest, tenant in self._entries:
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found

"""Parsing of store URLs and their query options (`capacity=8GiB`, `timeout=2s`, ...)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from storage.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)
_POW = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str | int) -> int:
    """`"8GiB"` -> 8589934592, `"500GB"` -> 500e9, `"4096"` -> 4096."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (try 512MiB, 8GiB, 2TB)")
    num, unit, binary = m.groups()
    base = 1024 if binary or unit == "" else 1000
    return int(float(num) * base ** _POW[unit.lower()])


def parse_seconds(text: str | float) -> float:
    s = str(text).strip().lower()
    scale = 1.0
    if s.endswith("ms"):
        s, scale = s[:-2], 1e-3
    elif s.endswith("s"):
        s = s[:-1]
    try:
        return float(s) * scale
    except ValueError as exc:
        raise ValueError(f"not a duration: {text!r} (try 2s, 500ms)") from exc


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    v = str(text).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


_MODE = re.compile(r"^0?o?([0-7]{3})$")


def parse_mode(text: str | int) -> int:
    """`"0640"` / `"640"` / `"0o640"` -> 0o640: permission bits for files a store creates;
    the owner must keep read and write, and chunk files get no execute bits."""
    if isinstance(text, int):
        mode = text
    else:
        m = _MODE.match(str(text).strip().lower())
        if not m:
            raise ValueError("expected an octal file mode such as 0600 or 0640")
        mode = int(m.group(1), 8)
    if not 0 <= mode <= 0o777 or mode & 0o600 != 0o600 or mode & 0o111:
        raise ValueError("expected an octal file mode with owner read and write and no "
                         "execute bits, such as 0600 or 0640")
    return mode


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


class StoreURL:
    """A split store URL: scheme, netloc, path and typed query options.

    `take(name, parse, default)` consumes one option; `finish()` rejects any option the
    backend did not take, naming it, so a typo fails at open rather than being ignored.
    """

    def __init__(self, url: str):
        self.url = url
        parts = urlsplit(url)
        self.scheme = parts.scheme.lower()
        self.netloc = parts.netloc
        self.path = parts.path
        try:
            pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
        except ValueError as exc:
            raise ConfigError(f"{self.redacted()}: malformed query string") from exc
        self._options: dict[str, str] = {}
        for k, v in pairs:
            if k in self._options:
                raise ConfigError(f"{self.redacted()}: option {k!r} given twice")
            self._options[k] = v

    def take(self, name: str, parse: Callable[[str], Any] = str, default: Any = None) -> Any:
        if name not in self._options:
            return default
        raw = self._options.pop(name)
        try:
            return parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{self.redacted()}: option {name}={raw!r}: {exc}") from exc

    def finish(self) -> None:
        if self._options:
            names = ", ".join(sorted(self._options))
            raise ConfigError(f"{self.redacted()}: unknown option(s) {names}")

    def redacted(self) -> str:
        """The URL with secret-looking options masked, for logs and errors."""
        return re.sub(
            r"((?:secret|token|password|key)[a-z_]*=)[^&]*", r"\1***", self.url, flags=re.I
        )

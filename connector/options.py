"""`CoreOptions`: the options every engine adapter takes, one vocabulary checked once at start.

The vLLM connector, the vLLM offloading tier, SGLang's HiCache backend and `KVConnector`
itself (the HF adapter's) read the same names, with the same defaults and meaning:

- `lookup_timeout_s` (2): the longest one lookup (one batched existence check) waits for
  the store; a slower answer is a miss.
- `load_deadline_s` (none): the longest a load waits for its chunks; what is not there by
  then is recomputed. None: the load policy's deadline (half the time recomputing the
  chunks takes, or up to all of it for a load predicted slower than that, between 0.05
  and 5 s; 5 s where the engine reports no prefill times).
- `max_in_flight` (8): chunk reads (and ChunkIO requests) one load keeps in flight.
- `breaker_failures` (1), `breaker_cooldown` (1 s), `breaker_max_cooldown` (30 s): the
  circuit breaker that bypasses a failing store (storage/breaker.py).
- `partial_reads` ("auto"): how a reader of part of each chunk (a tensor-parallel
  rank's heads) reads it: "ranges", the header and one ranged read per layer (it reads
  its share); "whole", each chunk in one read, keeping its share (fewer requests, every
  byte read: for stores whose requests cost more than their bytes, e.g. S3); "auto",
  ranges where the chunks are on this host (file://, memory://, a tier list whose first
  tier is a directory), whole elsewhere (s3://, http://, fsspec).

A bad value fails the engine's start with one line naming the setting (`OptionError`, a
ValueError), never a default in its place.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("kvstash.connector")


class OptionError(ValueError):
    """An adapter option that is unknown or out of range (one line, naming it)."""


@dataclass(frozen=True)
class CoreOptions:
    """The core's settings every adapter exposes (module docstring)."""

    lookup_timeout_s: float = 2.0
    load_deadline_s: float | None = None
    max_in_flight: int = 8
    breaker_failures: int = 1
    breaker_cooldown: float = 1.0
    breaker_max_cooldown: float = 30.0
    partial_reads: str = "auto"

    @classmethod
    def parse(cls, options: Mapping[str, Any], where: str,
              aliases: Mapping[str, tuple[str, ...]] | None = None) -> CoreOptions:
        """The core options among `options` (other keys are ignored: check them with
        `check_known`). `where` names the setting in errors (e.g.
        "kv_connector_extra_config"). `aliases`: a former name -> the names it sets,
        accepted with a warning unless one of those is given too."""
        given = dict(options)
        for old, new in (aliases or {}).items():
            if old not in given:
                continue
            value = given.pop(old)
            log.warning("%s: %s is deprecated; it sets %s", where, old, " and ".join(new))
            for name in new:
                given.setdefault(name, value)
        return cls(
            lookup_timeout_s=positive_float(given, "lookup_timeout_s", cls.lookup_timeout_s,
                                            where),
            load_deadline_s=(None if given.get("load_deadline_s") is None else
                             positive_float(given, "load_deadline_s", None, where)),
            max_in_flight=positive_int(given, "max_in_flight", cls.max_in_flight, where),
            breaker_failures=positive_int(given, "breaker_failures", cls.breaker_failures,
                                          where),
            breaker_cooldown=positive_float(given, "breaker_cooldown", cls.breaker_cooldown,
                                            where, zero=True),
            breaker_max_cooldown=positive_float(given, "breaker_max_cooldown",
                                                cls.breaker_max_cooldown, where, zero=True),
            partial_reads=one_of(given, "partial_reads", PARTIAL_READS, where),
        )

    def core_kwargs(self) -> dict[str, Any]:
        """These settings as `KVConnector` keyword arguments."""
        return asdict(self)


CORE_OPTIONS = frozenset(CoreOptions.__dataclass_fields__)
PARTIAL_READS = ("auto", "ranges", "whole")


def one_of(options: Mapping[str, Any], name: str, choices: tuple[str, ...], where: str) -> str:
    """`options[name]` (or the first of `choices`), which must be one of `choices`."""
    value = options.get(name, choices[0])
    if value not in choices:
        raise OptionError(f"{where}: {name}={value!r} must be one of "
                          + ", ".join(repr(c) for c in choices))
    return str(value)


def check_known(options: Mapping[str, Any], known: Collection[str], where: str) -> None:
    """Raise OptionError, in one line, for a key of `options` not in `known` (a misspelt
    option would otherwise be its default, without a word)."""
    unknown = sorted(set(options) - set(known), key=str)
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), list(known), n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise OptionError(f"{where}: unknown option {', '.join(hints)}; "
                      f"kvstash's options: {', '.join(sorted(known))}")


def positive_float(options: Mapping[str, Any], name: str, default: float | None, where: str,
                   *, zero: bool = False) -> float:
    """`options[name]` (or `default`) as a number > 0 (`zero`: >= 0); a numeric string
    reads as its number."""
    value = options.get(name, default)
    try:
        number = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        number = float("nan")
    if not (number >= 0 if zero else number > 0) or number == float("inf"):
        raise OptionError(f"{where}: {name}={value!r} must be a "
                          f"{'non-negative' if zero else 'positive'} number")
    return number


def positive_int(options: Mapping[str, Any], name: str, default: int, where: str) -> int:
    """`options[name]` (or `default`) as a whole number > 0; a numeric string reads as its
    number."""
    value = options.get(name, default)
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise TypeError(value)
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        number = 0
    if number <= 0:
        raise OptionError(f"{where}: {name}={value!r} must be a positive whole number")
    return number

"""What a doctor check reports: one finding per line, its severity, and the fix."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import IntEnum


class Level(IntEnum):
    """How much a finding matters; `UNSAFE` makes `kvstash doctor` exit non-zero."""

    OK = 0
    INFO = 1
    WARN = 2
    UNSAFE = 3


@dataclass(frozen=True)
class Finding:
    check: str  # a short dotted name: "fs.type", "s3.conditional", "server.ready"
    level: Level
    message: str  # what was found, one line
    fix: str = ""  # what to do about it ("" for OK and INFO findings)

    def line(self) -> str:
        tag = f"[{self.level.name.lower()}]" if self.level < Level.UNSAFE else "[UNSAFE]"
        text = f"{tag:<9}{self.check:<18}{self.message}"
        return f"{text} -> fix: {self.fix}" if self.fix else text


def ok(check: str, message: str) -> Finding:
    return Finding(check, Level.OK, message)


def info(check: str, message: str) -> Finding:
    return Finding(check, Level.INFO, message)


def warn(check: str, message: str, fix: str) -> Finding:
    return Finding(check, Level.WARN, message, fix)


def unsafe(check: str, message: str, fix: str) -> Finding:
    return Finding(check, Level.UNSAFE, message, fix)


def worst(findings: list[Finding]) -> Level:
    return max((f.level for f in findings), default=Level.OK)


def render_text(findings: list[Finding]) -> str:
    return "\n".join(f.line() for f in findings)


def render_json(findings: list[Finding]) -> str:
    return json.dumps([{**asdict(f), "level": f.level.name.lower()} for f in findings], indent=2)

"""Least-recently-used eviction plan for a bucket prefix, from one listing (a pure function).

How "used" is tracked on S3, where reads change nothing on the object: a chunk's last use
is the later of its own LastModified (when it was written) and the LastModified of its
*access marker*, a zero-byte object at `<scope>/.atime/<ns_id>/<digest>` that readers
rewrite after a hit, at most once per `touch` interval per process. Markers are plain
overwrites (no condition), so concurrent readers never conflict, and a marker without its
chunk is garbage that the next gc removes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from hashing import is_valid_key

MARKER_DIR = ".atime"


def marker_name(chunk_name: str) -> str:
    """`<scope>/<ns>/<digest>` -> `<scope>/.atime/<ns>/<digest>`."""
    head, ns, digest = ("/" + chunk_name).rsplit("/", 2)
    return f"{head}/{MARKER_DIR}/{ns}/{digest}".lstrip("/")


def classify(rel: str) -> tuple[str, str] | None:
    """("chunk", name) or ("marker", its chunk's name) for a name relative to the root prefix.

    Anything else (probes, quarantine, foreign objects) is None and never touched by gc.
    """
    parts = rel.split("/")
    if len(parts) < 2 or not is_valid_key(f"{parts[-2]}/{parts[-1]}"):
        return None
    scope = parts[:-2]
    if scope and scope[-1] == MARKER_DIR:
        return "marker", "/".join(scope[:-1] + parts[-2:])
    if any(p.startswith(".") for p in scope):
        return None
    return "chunk", rel


@dataclass
class EvictionPlan:
    used_bytes: int = 0
    chunks: int = 0
    delete: list[str] = field(default_factory=list)
    evicted: int = 0
    evicted_bytes: int = 0
    orphan_markers: int = 0


def plan_eviction(objects: Iterable[tuple[str, int, float]], capacity: int) -> EvictionPlan:
    """Which names to delete so the chunks fit in `capacity`, least recently used first.

    `objects` is (name relative to the root prefix, size, LastModified as epoch seconds).
    The plan deletes each victim's marker with it, and every marker whose chunk is gone.
    """
    chunks: dict[str, tuple[int, float]] = {}
    markers: dict[str, tuple[str, float]] = {}
    for rel, size, mtime in objects:
        kind = classify(rel)
        if kind is None:
            continue
        if kind[0] == "chunk":
            chunks[rel] = (size, mtime)
        else:
            markers[kind[1]] = (rel, mtime)
    plan = EvictionPlan(used_bytes=sum(s for s, _ in chunks.values()), chunks=len(chunks))
    for chunk, (marker, _) in markers.items():
        if chunk not in chunks:
            plan.delete.append(marker)
            plan.orphan_markers += 1
    by_use = sorted(
        chunks.items(), key=lambda kv: max(kv[1][1], markers.get(kv[0], ("", 0.0))[1])
    )
    for name, (size, _) in by_use:
        if plan.used_bytes <= capacity:
            break
        plan.delete.append(name)
        if name in markers:
            plan.delete.append(markers[name][0])
        plan.used_bytes -= size
        plan.chunks -= 1
        plan.evicted += 1
        plan.evicted_bytes += size
    return plan

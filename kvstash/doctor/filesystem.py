"""Doctor checks of a file:// store's root: its filesystem and mount options, permissions,
O_DIRECT and GDS, and free space against the configured capacity."""

from __future__ import annotations

import importlib.util
import mmap
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvstash.doctor.findings import Finding, info, ok, unsafe, warn
from storage.options import format_size

# Filesystems that live in memory: a store there is lost at reboot and competes with the
# engines for RAM.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
NFS_FILESYSTEMS = frozenset({"nfs", "nfs4"})
# Beyond this many entries the doctor stops counting what the store already holds (a large
# NFS store would take minutes to walk).
MAX_SCANNED_ENTRIES = 200_000
# NFS's default acdirmax: how long another host's new chunk may look absent.
NFS_DEFAULT_ACDIRMAX_S = 60


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo."""

    dev: str  # "major:minor"
    mount_point: str
    mount_options: tuple[str, ...]
    fstype: str
    source: str
    super_options: dict[str, str] = field(default_factory=dict)

    def option(self, name: str) -> str | None:
        """A mount or superblock option's value ("" for a flag), or None if absent."""
        if name in self.super_options:
            return self.super_options[name]
        return "" if name in self.mount_options else None


def _unescape(text: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (\040 ...).
    return text.encode().decode("unicode_escape") if "\\" in text else text


def parse_mountinfo(text: str) -> list[Mount]:
    """Every mount of a /proc/<pid>/mountinfo text (proc(5))."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 6 or len(tail) < 2:
            continue
        supers = {}
        for opt in (tail[2] if len(tail) > 2 else "").split(","):
            name, _, value = opt.partition("=")
            if name:
                supers[name] = value
        mounts.append(Mount(fields[2], _unescape(fields[4]), tuple(fields[5].split(",")),
                            tail[0], _unescape(tail[1]), supers))
    return mounts


def existing_ancestor(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (a root not created yet)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def mount_of(path: Path, mounts: list[Mount]) -> Mount | None:
    """The mount `path` lives on: the deepest mount point above it whose device is the
    path's own (bind mounts share a device number)."""
    real = existing_ancestor(path).resolve()
    dev = os.stat(real).st_dev
    want = f"{os.major(dev)}:{os.minor(dev)}"
    best: Mount | None = None
    for m in mounts:
        inside = real == Path(m.mount_point) or Path(m.mount_point) in real.parents
        if inside and (best is None or len(m.mount_point) >= len(best.mount_point)):
            if m.dev == want or best is None or best.dev != want:
                best = m
    return best


def read_mounts() -> list[Mount]:
    with open("/proc/self/mountinfo") as f:
        return parse_mountinfo(f.read())


def check_mount(root: Path, mount: Mount | None) -> list[Finding]:
    if mount is None:
        return [warn("fs.type", f"{root}: its mount is not in /proc/self/mountinfo",
                     "run the doctor on the host (or in the container) that serves the store")]
    where = f"{root} is on {mount.fstype} ({mount.source} at {mount.mount_point})"
    if mount.fstype in MEMORY_FILESYSTEMS:
        return [unsafe("fs.type", f"{where}: the store lives in RAM, competes with the "
                       "engines for memory and is lost at reboot",
                       "put the root on a disk or an NFS mount")]
    if mount.fstype == "overlay":
        return [unsafe("fs.type", f"{where}: a container's writable layer, lost with the "
                       "container, never shared by replicas, slow to write",
                       "mount a volume (or the NFS export) at the store's root")]
    out = [ok("fs.type", where)]
    if mount.fstype in NFS_FILESYSTEMS:
        out += check_nfs_options(mount)
    if "ro" in mount.mount_options or mount.option("ro") is not None:
        out.append(unsafe("fs.mount", f"{mount.mount_point} is mounted read-only: every "
                          "save fails", "remount it read-write"))
    return out


def check_nfs_options(mount: Mount) -> list[Finding]:
    """lookupcache, nconnect and attribute caching of an NFS mount."""
    out = []
    lookup = mount.option("lookupcache")
    acdirmax = mount.option("acdirmax") or mount.option("actimeo")
    if lookup in ("pos", "positive"):
        out.append(ok("nfs.lookupcache", f"{mount.mount_point}: lookupcache=positive"))
    elif lookup == "none":
        out.append(warn("nfs.lookupcache", f"{mount.mount_point}: lookupcache=none: every "
                        "lookup is a round trip to the server",
                        "mount with lookupcache=positive (correct for kvstash, and cheaper)"))
    else:
        age = acdirmax or str(NFS_DEFAULT_ACDIRMAX_S)
        out.append(warn("nfs.lookupcache", f"{mount.mount_point}: lookupcache=all (default): "
                        f"another host's new chunk looks absent for up to {age}s (misses)",
                        "mount with lookupcache=positive"))
    nconnect = int(mount.option("nconnect") or 1)
    if nconnect >= 4:
        out.append(ok("nfs.nconnect", f"{mount.mount_point}: nconnect={nconnect}"))
    else:
        out.append(warn("nfs.nconnect", f"{mount.mount_point}: nconnect={nconnect}: one TCP "
                        "connection carries every read, a ceiling well below the link",
                        "mount with nconnect=8..16 (Linux 5.3+)"))
    if mount.option("noac") is not None or mount.option("actimeo") == "0" or (
            mount.option("acregmax") == "0"):
        out.append(warn("nfs.actimeo", f"{mount.mount_point}: attribute caching is off "
                        "(noac/actimeo=0): every open costs a GETATTR round trip",
                        "drop noac/actimeo=0: chunks are immutable, cached attributes are safe"))
    else:
        values = ",".join(f"{k}={mount.option(k)}" for k in ("actimeo", "acregmax", "acdirmax")
                          if mount.option(k))
        out.append(ok("nfs.actimeo", f"{mount.mount_point}: attribute caching on"
                      + (f" ({values})" if values else " (defaults)")))
    return out


def check_permissions(root: Path) -> list[Finding]:
    if not root.exists():
        parent = existing_ancestor(root)
        if os.access(parent, os.W_OK | os.X_OK):
            return [info("fs.permissions", f"{root} does not exist yet; the store creates it "
                         f"under {parent} (writable)")]
        return [unsafe("fs.permissions", f"{root} does not exist and {parent} is not writable "
                       "by this user", f"create {root} and give it to the server's user")]
    mode = stat.S_IMODE(root.stat().st_mode)
    out = []
    if not os.access(root, os.W_OK | os.X_OK):
        out.append(unsafe("fs.permissions", f"{root} (mode {mode:04o}) is not writable by "
                          f"uid {os.geteuid()}: every save fails",
                          f"chown the root to the server's user (`chown -R USER {root}`)"))
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        out.append(unsafe("fs.permissions", f"{root} is world-writable (mode {mode:04o}): any "
                          "local user can delete or fill the cache", f"chmod 700 {root}"))
    elif mode & stat.S_IROTH:
        out.append(warn("fs.permissions", f"{root} is world-readable (mode {mode:04o}): other "
                        "local users can read cached KV (prompt contents)", f"chmod 700 {root}"))
    if not out:
        out.append(ok("fs.permissions", f"{root} mode {mode:04o}, writable by this user"))
    return out


def check_direct_io(root: Path, fstype: str | None) -> Finding:
    """Whether a chunk file under `root` opens and writes with O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        return info("fs.o_direct", "this platform has no O_DIRECT: buffered reads only")
    if fstype in MEMORY_FILESYSTEMS or fstype == "overlay":
        return info("fs.o_direct", f"{fstype}: read buffered (no O_DIRECT), as kvstash does "
                    "on memory and overlay filesystems")
    if not root.is_dir() or not os.access(root, os.W_OK):
        return info("fs.o_direct", f"{root}: not probed (not a writable directory yet)")
    fd, path = tempfile.mkstemp(prefix=".kvstash-doctor.", dir=root)
    os.close(fd)
    try:
        dfd = os.open(path, os.O_WRONLY | os.O_DIRECT)
        try:
            with mmap.mmap(-1, 4096) as page:  # page-aligned, as O_DIRECT wants
                os.write(dfd, page)
        finally:
            os.close(dfd)
    except OSError as exc:
        return warn("fs.o_direct", f"{root}: O_DIRECT refused ({exc.strerror}): every read "
                    "goes through the page cache", "fine for small stores; for NVMe or GDS "
                    "use a filesystem that takes O_DIRECT (ext4, xfs, NFS)")
    finally:
        os.unlink(path)
    return ok("fs.o_direct", f"{root}: O_DIRECT reads and writes work")


def check_gds(root: Path) -> Finding:
    """GPUDirect Storage through gds.probe, on an engine host with torch and CUDA."""
    if importlib.util.find_spec("torch") is None:
        return info("gds", "torch is not installed (a server host): GDS concerns engine hosts "
                    "only")
    from gds.probe import probe

    caps = probe(str(root) if root.is_dir() else None)
    if not caps.cuda:
        return info("gds", "no CUDA device: loads use host memory")
    if caps.torch_gds or caps.kvikio:
        via = "torch.cuda.gds" if caps.torch_gds else "KvikIO"
        return ok("gds", f"GPUDirect Storage reads work under {root} ({via})")
    return warn("gds", f"CUDA without GPUDirect Storage under {root}: loads go through pinned "
                f"bounce buffers ({'; '.join(caps.notes)})",
                "install nvidia-fs and cuFile (docs/gds.md) for direct NVMe/NFS-to-GPU reads")


def _bytes_under(root: Path) -> int | None:
    """Bytes of the files under `root`, or None past MAX_SCANNED_ENTRIES entries."""
    total = seen = 0
    stack = [str(root)]
    while stack:
        try:
            entries = os.scandir(stack.pop())
        except OSError:
            continue
        with entries:
            for entry in entries:
                seen += 1
                if seen > MAX_SCANNED_ENTRIES:
                    return None
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


def check_space(root: Path, capacity: int | None) -> list[Finding]:
    st = os.statvfs(existing_ancestor(root))
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    if capacity is None:
        return [warn("fs.capacity", f"no capacity set: the store grows until the filesystem "
                     f"({format_size(size)}, {format_size(free)} free) is full",
                     "add ?capacity=SIZE to the store URL (at most ~90% of what is free)")]
    held = _bytes_under(root) if root.is_dir() else 0
    room = free + (held or 0)
    line = (f"capacity {format_size(capacity)}; filesystem {format_size(size)}, "
            f"{format_size(free)} free" + (f", store holds {format_size(held)}" if held else ""))
    if capacity > size:
        return [unsafe("fs.capacity", f"{line}: the capacity exceeds the whole filesystem, so "
                       "saves fail (disk full) before eviction starts",
                       f"set capacity below {format_size(size * 0.9)}")]
    if capacity > room:
        return [warn("fs.capacity", f"{line}: the disk fills before the store reaches its "
                     "capacity (other data is growing there)",
                     f"lower capacity to ~{format_size(room * 0.9)} or free space")]
    return [ok("fs.capacity", line)]

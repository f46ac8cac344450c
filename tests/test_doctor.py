"""`kvstash doctor` finds what makes a deployment slow or unsafe, on real setups made here:
a tmpfs root and an overlay root (real mounts, root needed), world-readable tokens files
and store roots, a capacity beyond the filesystem, S3 servers with and without conditional
writes (moto, and moto behind a proxy that drops If-None-Match), a running kvserver.

NFS cannot be mounted here (no NFS server or client): its mount options are checked from
/proc/self/mountinfo lines written as an NFS mount shows them, and say so."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstash.doctor.filesystem import check_nfs_options, mount_of, parse_mountinfo
from kvstash.doctor.findings import Level
from kvstash.doctor.s3 import check_skew
from tests.kvserver_fixtures import running_kvserver
from tests.s3_fixtures import FaultProxy, endpoint_of, moto_s3_url, with_prefix  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent


def doctor(*flags: str, env: dict[str, str] | None = None) -> tuple[int, list[dict]]:
    """Run `kvstash doctor --json FLAGS` as a user would; (exit code, findings)."""
    proc = subprocess.run([sys.executable, "-m", "kvstash.cli", "doctor", "--json", *flags],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def find(findings: list[dict], check: str) -> dict:
    matches = [f for f in findings if f["check"] == check]
    assert matches, (check, findings)
    return matches[0]


@contextlib.contextmanager
def mounted(kind: str, target: Path, options: str) -> Iterator[Path]:
    target.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip(f"mounting {kind} needs root")
    done = subprocess.run(["mount", "-t", kind, "-o", options, kind, str(target)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount {kind} here: {done.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def test_tmpfs_root_is_unsafe(tmp_path):
    with mounted("tmpfs", tmp_path / "mnt", "size=64m,mode=0700") as mnt:
        code, findings = doctor("--store", f"file://{mnt}/kv?capacity=32MiB")
    fs = find(findings, "fs.type")
    assert code == 1
    assert fs["level"] == "unsafe" and "tmpfs" in fs["message"] and "RAM" in fs["message"]
    assert fs["fix"]


def test_overlay_root_is_unsafe(tmp_path):
    for d in ("lower", "upper", "work"):
        (tmp_path / d).mkdir()
    opts = f"lowerdir={tmp_path}/lower,upperdir={tmp_path}/upper,workdir={tmp_path}/work"
    with mounted("overlay", tmp_path / "merged", opts) as mnt:
        code, findings = doctor("--store", f"file://{mnt}/kv?capacity=32MiB")
    fs = find(findings, "fs.type")
    assert code == 1
    assert fs["level"] == "unsafe" and "overlay" in fs["message"] and "volume" in fs["fix"]
    assert find(findings, "fs.o_direct")["level"] == "info"  # read buffered there


def test_world_readable_tokens_file_is_unsafe(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("alice a-token-of-sixteen-chars\n")
    tokens.chmod(0o644)
    code, findings = doctor("--auth-tokens", str(tokens))
    f = find(findings, "tokens.mode")
    assert code == 1 and f["level"] == "unsafe" and f"chmod 600 {tokens}" in f["fix"]


def test_private_tokens_file_is_fine(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("alice a-token-of-sixteen-chars\n* an-admin-token-of-sixteen\n")
    tokens.chmod(0o600)
    code, findings = doctor("--auth-tokens", str(tokens))
    f = find(findings, "tokens.file")
    assert code == 0 and f["level"] == "ok" and "alice" in f["message"]


def test_local_disk_root_with_room_is_fine(tmp_path):
    (tmp_path / "kv").mkdir(mode=0o700)
    code, findings = doctor("--store", f"file://{tmp_path}/kv?capacity=1MiB")
    assert code == 0, findings
    assert find(findings, "fs.capacity")["level"] == "ok"
    assert find(findings, "fs.permissions")["level"] == "ok"
    assert find(findings, "fs.o_direct")["level"] in ("ok", "warn")  # as the disk allows
    assert find(findings, "gds")["level"] in ("info", "ok", "warn")


def test_world_writable_root_is_unsafe(tmp_path):
    root = tmp_path / "kv"
    root.mkdir()
    root.chmod(0o777)
    code, findings = doctor("--store", f"file://{root}?capacity=1MiB")
    f = find(findings, "fs.permissions")
    assert code == 1 and f["level"] == "unsafe" and "world-writable" in f["message"]


def test_capacity_beyond_the_filesystem_is_unsafe(tmp_path):
    code, findings = doctor("--store", f"file://{tmp_path}/kv?capacity=1000PiB")
    f = find(findings, "fs.capacity")
    assert code == 1 and f["level"] == "unsafe" and "exceeds the whole filesystem" in f["message"]


def test_no_capacity_is_a_warning(tmp_path):
    code, findings = doctor("--store", f"file://{tmp_path}/kv")
    assert code == 0 and find(findings, "fs.capacity")["level"] == "warn"
    strict = subprocess.run([sys.executable, "-m", "kvstash.cli", "doctor", "--strict",
                             "--store", f"file://{tmp_path}/kv"], capture_output=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert strict.returncode == 1


# As /proc/self/mountinfo shows NFS mounts (a fake: no NFS client or server runs here).
NFS_DEFAULT = ("601 29 0:55 / /mnt/kv rw,relatime shared:300 - nfs4 filer:/export "
               "rw,vers=4.2,rsize=1048576,wsize=1048576,namlen=255,hard,proto=tcp,"
               "timeo=600,retrans=2,sec=sys,clientaddr=10.0.0.2,local_lock=none,addr=10.0.0.1")
NFS_TUNED = ("602 29 0:56 / /mnt/kv2 rw,relatime shared:301 - nfs4 filer:/export "
             "rw,vers=4.2,rsize=1048576,wsize=1048576,namlen=255,acdirmax=30,hard,"
             "nconnect=16,proto=tcp,timeo=600,retrans=2,sec=sys,lookupcache=pos,addr=10.0.0.1")
NFS_NOAC = ("603 29 0:57 / /mnt/kv3 rw,relatime - nfs filer:/export "
            "rw,sync,vers=3,acregmin=0,acregmax=0,acdirmin=0,acdirmax=0,hard,noac,proto=tcp")


def test_nfs_default_mount_options_are_warned():
    (mount,) = parse_mountinfo(NFS_DEFAULT)
    levels = {f.check: f for f in check_nfs_options(mount)}
    assert levels["nfs.lookupcache"].level == Level.WARN
    assert "lookupcache=positive" in levels["nfs.lookupcache"].fix
    assert levels["nfs.nconnect"].level == Level.WARN and "nconnect=8" in levels["nfs.nconnect"].fix
    assert levels["nfs.actimeo"].level == Level.OK


def test_nfs_tuned_mount_options_pass():
    (mount,) = parse_mountinfo(NFS_TUNED)
    assert all(f.level == Level.OK for f in check_nfs_options(mount)), check_nfs_options(mount)


def test_nfs_without_attribute_cache_is_warned():
    (mount,) = parse_mountinfo(NFS_NOAC)
    levels = {f.check: f.level for f in check_nfs_options(mount)}
    assert levels["nfs.actimeo"] == Level.WARN


def test_mount_of_a_path_is_its_deepest_mount(tmp_path):
    mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    m = mount_of(tmp_path / "not" / "yet", mounts)
    assert m is not None and (tmp_path == Path(m.mount_point) or Path(m.mount_point) in tmp_path.parents)


def test_clock_skew_thresholds():
    assert check_skew(0.4).level == Level.OK
    assert check_skew(-45.0).level == Level.WARN
    assert check_skew(1200.0).level == Level.UNSAFE
    assert check_skew(None).level == Level.WARN


def test_s3_with_conditional_writes_passes(moto_s3_url):  # noqa: F811
    code, findings = doctor("--store", with_prefix(moto_s3_url))
    assert find(findings, "s3.reach")["level"] == "ok"
    assert find(findings, "s3.conditional")["level"] == "ok"  # moto enforces If-None-Match
    assert find(findings, "s3.clock")["level"] == "ok"
    assert code == 0, findings


def test_s3_without_conditional_writes_is_warned(moto_s3_url):  # noqa: F811
    """moto enforces If-None-Match; a proxy in front of it that drops the header stands in
    for a server that ignores conditional writes."""
    proxy = FaultProxy(endpoint_of(moto_s3_url)).start()
    proxy.strip_if_none_match = True
    try:
        url = with_prefix(moto_s3_url).replace(endpoint_of(moto_s3_url), proxy.endpoint)
        code, findings = doctor("--store", url)
    finally:
        proxy.stop()
    f = find(findings, "s3.conditional")
    assert f["level"] == "warn" and "ignores If-None-Match" in f["message"]
    assert code == 0


def test_missing_bucket_is_unsafe(moto_s3_url):  # noqa: F811
    url = moto_s3_url.replace("s3://kvstash-test/", "s3://no-such-bucket-here/")
    code, findings = doctor("--store", url)
    assert code == 1 and find(findings, "s3.reach")["level"] == "unsafe"


def test_running_kvserver_reports_version_limits_and_readiness(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("alice alice-token-0123456789\n* admin-token-0123456789\n")
    tokens.chmod(0o600)
    with running_kvserver("--store", f"file://{tmp_path}/kv?capacity=64MiB",
                          "--auth-tokens", str(tokens), "--max-chunk-bytes", "8MiB") as srv:
        # A generous --timeout: the server shares the machine with the rest of the suite.
        code, findings = doctor("--server", srv.url, "--token", "admin-token-0123456789",
                                "--timeout", "60")
        _, anonymous = doctor("--server", srv.url, "--timeout", "60")
    assert code == 0, findings
    assert find(findings, "server.ready")["level"] == "ok"
    assert find(findings, "server.version")["level"] == "ok"
    assert "max chunk 8.0 MiB" in find(findings, "server.limits")["message"]
    assert find(findings, "server.auth")["level"] == "ok"
    assert find(anonymous, "server.version")["level"] == "warn"  # asks for a token


def test_a_kvserver_that_never_answers_is_a_finding_within_the_timeout():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        port = silent.getsockname()[1]
        code, findings = doctor("--server", f"http://127.0.0.1:{port}", "--timeout", "0.5")
    assert code == 1
    health = find(findings, "server.health")
    assert health["level"] == "unsafe" and "--timeout" in health["fix"]


def test_unreachable_kvserver_is_unsafe():
    code, findings = doctor("--server", "http://127.0.0.1:9")
    assert code == 1 and find(findings, "server.health")["level"] == "unsafe"

"""`kvstash doctor`: what makes a deployment slow or unsafe, one finding per line with its fix.

`--store URL` (repeatable) checks a backend: for file://, the filesystem and its mount
options, permissions, O_DIRECT and GDS, free space against the capacity; for s3://,
reachability and addressing, conditional writes, clock skew; an http:// URL is a kvserver.
`--server URL` checks a running kvserver; `--auth-tokens FILE` its tokens file. The exit
code is 1 when any finding is UNSAFE (`--strict`: also on a warning), else 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvstash.doctor.findings import Finding, Level, render_json, render_text, unsafe, worst
from storage.errors import ConfigError
from storage.options import StoreURL, parse_size

TOKEN_ENV = "KVSTASH_TOKEN"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", action="append", default=[], metavar="URL",
                   help="a store URL to check (file://, s3://, http://); repeat for tiers")
    p.add_argument("--server", action="append", default=[], metavar="URL",
                   help="a running kvserver (http://host:port); its token from --token, "
                        f"?token= or ${TOKEN_ENV}")
    p.add_argument("--token", help="bearer token for --server (an admin token sees all)")
    p.add_argument("--auth-tokens", metavar="FILE", type=Path,
                   help="a kvserver tokens file to check")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                   help="how long one request to --server may take (default 5)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 on warnings too")


def check_file_store(url: str) -> list[Finding]:
    from kvstash.doctor import filesystem as fs

    u = StoreURL(url)
    root = Path(u.path)
    capacity = u.take("capacity", parse_size)
    mount = fs.mount_of(root, fs.read_mounts())
    return [*fs.check_mount(root, mount), *fs.check_permissions(root),
            fs.check_direct_io(root, mount.fstype if mount else None), fs.check_gds(root),
            *fs.check_space(root, capacity)]


def check_store(url: str, token: str | None, timeout: float = 5.0) -> list[Finding]:
    scheme = StoreURL(url).scheme
    if scheme == "file":
        return check_file_store(url)
    if scheme == "s3":
        from kvstash.doctor.s3 import check_s3

        return check_s3(url)
    if scheme in ("http", "https"):
        from kvstash.doctor.server import check_server

        return check_server(url, token, timeout)
    return [Finding("store", Level.INFO, f"{StoreURL(url).redacted()}: no checks for "
                    f"{scheme}:// stores")]


def diagnose(args: argparse.Namespace) -> list[Finding]:
    token = args.token or os.environ.get(TOKEN_ENV)
    findings: list[Finding] = []
    for url in args.store:
        try:
            findings += check_store(url, token, args.timeout)
        except ConfigError as exc:
            findings.append(unsafe("store.url", str(exc), "fix the store URL"))
    if args.auth_tokens is not None:
        from kvstash.doctor.server import check_tokens

        findings += check_tokens(args.auth_tokens)
    for url in args.server:
        from kvstash.doctor.server import check_server

        findings += check_server(url, token, args.timeout)
    return findings


def run(args: argparse.Namespace) -> int:
    if not (args.store or args.server or args.auth_tokens):
        raise ValueError("nothing to check: give --store URL, --server URL or --auth-tokens FILE")
    findings = diagnose(args)
    print(render_json(findings) if args.json else render_text(findings))
    level = worst(findings)
    if not args.json:
        counts = {lv: sum(f.level == lv for f in findings) for lv in Level}
        print(f"-- {counts[Level.UNSAFE]} unsafe, {counts[Level.WARN]} warnings, "
              f"{counts[Level.OK] + counts[Level.INFO]} fine", file=sys.stderr)
    return 1 if level >= Level.UNSAFE or (args.strict and level >= Level.WARN) else 0

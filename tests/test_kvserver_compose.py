"""docker-compose.yml and the Dockerfile are consistent and complete. No Docker engine runs
here, so this checks what can be checked without one: the YAML parses, every service,
volume, config and network it names is declared, every file the Dockerfile copies exists,
the kvserver command parses as `kvstash serve` flags, and the credentials agree."""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
import shlex
from pathlib import Path

import yaml

from kvserver.auth import TokenTable
from kvserver.cli import add_arguments
from storage.options import StoreURL
from storage.registry import BACKENDS

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def test_compose_has_kvserver_an_s3_server_and_an_nfs_server():
    assert {"kvserver", "seaweedfs", "nfs"} <= set(SERVICES)
    assert "seaweedfs" in SERVICES["seaweedfs"]["image"]
    assert "nfs" in SERVICES["nfs"]["image"]


def test_every_reference_is_declared():
    for name, svc in SERVICES.items():
        deps = svc.get("depends_on", [])
        for dep in deps if isinstance(deps, list) else deps.keys():
            assert dep in SERVICES, (name, dep)
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if not source.startswith(("/", ".")):
                assert source in COMPOSE["volumes"], (name, source)
        for cfg in svc.get("configs", []):
            assert cfg["source"] in COMPOSE["configs"], (name, cfg)
        nets = svc.get("networks", [])
        for net in nets if isinstance(nets, list) else nets.keys():
            assert net in COMPOSE["networks"], (name, net)


def test_dockerfile_copies_only_what_exists():
    build = SERVICES["kvserver"]["build"]
    context = ROOT / (build if isinstance(build, str) else build["context"])
    dockerfile = (context / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            *sources, _ = shlex.split(line)[1:]
            for src in sources:
                assert (context / src).exists(), src
    assert 'ENTRYPOINT ["kvstash", "serve"' in dockerfile


def test_kvserver_command_is_valid_serve_flags(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    svc = SERVICES["kvserver"]
    args = parser.parse_args(["--host", "0.0.0.0", *svc["command"]])
    assert len(args.store) == 2
    for url in args.store:
        assert StoreURL(url).scheme in BACKENDS
    targets = {c["target"]: c["source"] for c in svc["configs"]}
    tokens = COMPOSE["configs"][targets[str(args.auth_tokens)]]["content"]
    (tmp_path / "tokens").write_text(tokens)
    (tmp_path / "tokens").chmod(0o600)
    assert TokenTable.from_file(tmp_path / "tokens").tenants == ["demo"]


def test_s3_credentials_and_nfs_address_agree():
    s3 = json.loads(COMPOSE["configs"]["seaweedfs_s3"]["content"])
    cred = s3["identities"][0]["credentials"][0]
    env = SERVICES["kvserver"]["environment"]
    assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == (cred["accessKey"], cred["secretKey"])
    s3_url = next(a for a in SERVICES["kvserver"]["command"] if a.startswith("s3://"))
    assert "seaweedfs:8333" in s3_url and "-s3.port=8333" in SERVICES["seaweedfs"]["command"]
    nfs_ip = SERVICES["nfs"]["networks"]["kvnet"]["ipv4_address"]
    subnet = COMPOSE["networks"]["kvnet"]["ipam"]["config"][0]["subnet"]
    assert ipaddress.ip_address(nfs_ip) in ipaddress.ip_network(subnet)
    opts = COMPOSE["volumes"]["nfskv"]["driver_opts"]
    assert re.search(rf"addr={re.escape(nfs_ip)}\b", opts["o"]) and opts["type"] == "nfs"

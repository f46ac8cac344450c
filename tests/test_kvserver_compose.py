"""docker-compose.yml, its check override and the Dockerfile: consistent and complete, and,
where a Docker engine runs, started for real.

The static tests run everywhere: the YAML parses, every service, volume, config and
network it names is declared, every file the Dockerfile copies exists, each replica's
command parses as `kvstash serve` flags, the credentials agree, and the check override
keeps every service on loopback. `test_compose_stack_serves_through_two_replicas` runs
scripts/compose-check.sh (images built from Debian packages, two replicas over a shared
volume standing in for the NFS export, SeaweedFS, a replica restarted under load): it is
marked `docker`, which the default suite deselects (minutes long), and skips unless
`docker info` succeeds (CI has the client but no engine)."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvserver.auth import TokenTable
from kvserver.cli import add_arguments
from storage.options import StoreURL
from storage.registry import BACKENDS


class ComposeLoader(yaml.SafeLoader):
    """YAML with compose's merge tags (`!reset`, `!override`) read as plain values."""


for _tag in ("!reset", "!override"):
    ComposeLoader.add_constructor(_tag, lambda loader, node: (
        loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode)
        else loader.construct_mapping(node) if isinstance(node, yaml.MappingNode)
        else loader.construct_scalar(node)))

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
CHECK = yaml.load((ROOT / "deploy" / "compose-check.yml").read_text(), ComposeLoader)
SERVICES = COMPOSE["services"]
REPLICAS = ("kvserver", "kvserver-2")


def test_compose_has_two_replicas_an_s3_server_and_an_nfs_server():
    assert {*REPLICAS, "seaweedfs", "nfs"} <= set(SERVICES)
    assert "seaweedfs" in SERVICES["seaweedfs"]["image"]
    assert "nfs" in SERVICES["nfs"]["image"]
    assert SERVICES["kvserver"]["command"] == SERVICES["kvserver-2"]["command"]
    assert SERVICES["kvserver"]["volumes"] == SERVICES["kvserver-2"]["volumes"]  # one backend


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
    assert "ARG BASE=python:3.11-slim" in dockerfile  # users keep the public base


def test_replica_commands_are_valid_serve_flags(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for name in REPLICAS:
        svc = SERVICES[name]
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
    assert "lookupcache=positive" in opts["o"]  # what `kvstash doctor` asks of NFS mounts


def test_check_override_keeps_every_service_on_loopback():
    services = CHECK["services"]
    for name in (*REPLICAS, "seaweedfs", "create-bucket"):
        svc = services[name]
        assert svc["network_mode"] == "host", name
        text = json.dumps(svc)
        assert not re.search(r"\b(10|172|192)\.\d+\.\d+\.\d+", text), name
        assert "127.0.0.1" in text or name == "seaweedfs" and "-ip.bind=127.0.0.1" in text
    for name in REPLICAS:
        assert services[name]["build"]["network"] == "none"  # no registry, no PyPI
        assert "--host" in services[name]["command"]
        assert services[name]["command"][services[name]["command"].index("--host") + 1] == "127.0.0.1"
    assert services["nfs"]["profiles"]  # not started: a volume stands in for the export


def _docker_usable() -> str | None:
    if shutil.which("docker") is None:
        return "no docker client"
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "`docker info` timed out"
    if info.returncode != 0:
        return "no running Docker engine (`docker info` failed)"
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        return "no docker compose plugin"
    return None


@pytest.mark.docker
@pytest.mark.timeout(1800)
def test_compose_stack_serves_through_two_replicas(tmp_path):
    why = _docker_usable()
    if why:
        pytest.skip(why)
    venv = Path(sys.prefix)  # the virtualenv running the tests: the script's host Python
    proc = subprocess.run([str(ROOT / "scripts" / "compose-check.sh"), str(tmp_path)],
                          capture_output=True, text=True, timeout=1700, cwd=ROOT,
                          env={**os.environ, "VENV": str(venv)})
    assert proc.returncode == 0, proc.stderr[-3000:] + (tmp_path / "client.log").read_text()[-3000:]
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["replicas"] == 2 and figures["restarts"] == 1
    assert figures["lost"] == 0 and figures["wrong"] == 0
    assert figures["saved"] > 0 and figures["cross_loads"] > 0

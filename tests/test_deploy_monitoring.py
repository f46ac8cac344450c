"""The Grafana dashboard and the Prometheus alert rules under deploy/ name only metrics that
exist: kvserver's in a real server's /metrics, vLLM's `vllm:kvstash_*` counters in the
connector's counter definitions (scraping a real vLLM engine's /metrics is too heavy for
the suite: the connector makes one `vllm:kvstash_<name>` counter per name of
connector.core.COUNTERS, which prometheus_client exports with a `_total` suffix)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml

from tests.kvserver_fixtures import running_kvserver

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "kvstash.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
METRIC = re.compile(r"\b(vllm:kvstash_[a-z_]+|kvstash_[a-z_]+)")
ALERT_NAMES = {"breaker": "KvstashBreakerOpen", "capacity": "KvstashCapacityNearFull",
               "error rate": "KvstashErrorRate", "hit rate": "KvstashHitRateCollapse"}


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def named(exprs: list[str]) -> set[str]:
    return {m for e in exprs for m in METRIC.findall(e)}


@pytest.fixture(scope="module")
def server_metrics(tmp_path_factory) -> set[str]:
    """Sample names of a real kvserver's /metrics after one PUT, GET, miss and lookup."""
    where = tmp_path_factory.mktemp("metrics")
    with running_kvserver("--store", f"file://{where}/kv?capacity=16MiB") as srv:
        from hashing import Namespace
        from tests.store_helpers import make_chunks

        ns = Namespace(model="m", dtype="f", layout="l", chunk_tokens=16)
        ((key, _, blob),) = make_chunks(ns, 1)
        with httpx.Client(base_url=srv.url) as c:
            c.put(f"/v1/chunks/{key}", content=blob,
                  headers={"content-type": "application/octet-stream"}).raise_for_status()
            c.get(f"/v1/chunks/{key}").raise_for_status()
            c.get(f"/v1/chunks/{'0' * 16}/{'1' * 32}")
            c.post("/v1/lookup", json={"keys": [key]}).raise_for_status()
            text = c.get("/metrics").text
    return {line.split("{")[0].split()[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def engine_metrics() -> set[str]:
    from connector.core import COUNTERS

    # The vLLM connector's Prometheus metrics (KvstashPromMetrics) are one counter per name
    # in COUNTERS: checked in its source, since building them needs a running engine.
    sources = [p.read_text() for p in (ROOT / "connector").glob("vllm*.py")]
    assert any('name=f"vllm:kvstash_{name}"' in source
               and "for name, doc in COUNTERS.items()" in source for source in sources)
    return {f"vllm:kvstash_{name}_total" for name in COUNTERS}


def check_names(names: set[str], server: set[str]) -> list[str]:
    engine = engine_metrics()
    missing = []
    for name in sorted(names):
        if name.startswith("vllm:"):
            ok = name in engine
        else:
            ok = name in server  # histograms appear as their _bucket, _sum, _count samples
        if not ok:
            missing.append(name)
    return missing


def test_dashboard_names_only_metrics_that_exist(server_metrics):
    names = named(dashboard_exprs())
    assert any(n.startswith("vllm:") for n in names) and any(n.startswith("kvstash_") for n in names)
    assert check_names(names, server_metrics) == []


def test_alerts_name_only_metrics_that_exist(server_metrics):
    names = named([r["expr"] for r in alert_rules()])
    assert check_names(names, server_metrics) == []


def test_alerts_cover_breaker_capacity_errors_and_hit_rate():
    rules = {r["alert"]: r for r in alert_rules()}
    for what, alert in ALERT_NAMES.items():
        assert alert in rules, what
    for rule in rules.values():
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        assert rule["annotations"]["summary"]


def test_dashboard_panels_are_laid_out_without_overlap():
    panels = json.loads(DASHBOARD.read_text())["panels"]
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, p["title"]
                cells.add((x, y))

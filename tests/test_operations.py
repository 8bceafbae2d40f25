"""docs/OPERATIONS.md and deploy/ against what the server really has: every config.pbtxt parameter
documented with its shipped value, every metric the Grafana dashboard queries exported by a running
server (scraped after requests with images), every exported zipmoe metric documented, and the
Kubernetes probes and Prometheus targets on Triton's health and metrics ports."""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
import yaml

from test_images_server import note
from test_interface import REPOSITORY, config
from zipmoe.clients.triton_client import grpc_generate

REPO = Path(__file__).resolve().parents[1]
OPERATIONS = (REPO / "docs" / "OPERATIONS.md").read_text()
DASHBOARD = json.loads((REPO / "deploy" / "grafana" / "zipmoe.json").read_text())
METRIC = re.compile(r"\b(?:zipmoe|nv)_[a-z0-9_]+\b")
MODELS = sorted(p.parent.name for p in REPOSITORY.glob("*/config.pbtxt"))


def documented_parameters() -> dict[tuple[str, str], str]:
    """(model, parameter) -> the row's default column, from the configuration table."""
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \| [^|]+ \| ([^|]+) \|", OPERATIONS, re.M)
    return {(model, name): default.strip().strip("`") for model, name, default in rows}


def test_every_config_parameter_is_documented_with_its_shipped_value():
    shipped = {(m, k): v.string_value for m in MODELS for k, v in config(m).parameters.items()}
    assert documented_parameters() == shipped


def scrape(server) -> tuple[set[str], set[str]]:
    """The sample names of the server's /metrics (histograms as their _bucket, _sum, _count) and its families."""
    with urllib.request.urlopen(f"http://{server.url_metrics}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    samples = {line.split("{")[0].split(" ")[0] for line in lines if line and not line.startswith("#")}
    return samples, {line.split()[2] for line in lines if line.startswith("# TYPE ")}


def queries(dashboard: dict) -> set[str]:
    return {name for panel in dashboard["panels"] for target in panel["targets"]
            for name in METRIC.findall(target["expr"])}


@pytest.mark.integration
def test_the_dashboard_queries_only_metrics_the_server_exports(zipmoe_server):
    for model in ("mm_qa", "mm_qa_bls"):  # vision, decoder and cache metrics all get a sample
        list(grpc_generate(zipmoe_server.url_grpc, model=model, text_input="What?", images=[note(0), note(1)],
                           max_tokens=4, stream=True))
    samples, families = scrape(zipmoe_server)
    wanted = queries(DASHBOARD)
    assert {"zipmoe_ttft_seconds_bucket", "zipmoe_inter_token_latency_seconds_bucket",
            "zipmoe_visual_tokens_kept_total", "zipmoe_moe_union_after_total", "zipmoe_waiting_requests",
            "zipmoe_kv_blocks_free"} <= wanted  # the panels: latency distributions, tokens kept, experts, queue, KV
    assert wanted <= samples, f"the dashboard queries metrics the server does not export: {sorted(wanted - samples)}"
    undocumented = {f for f in families if f.startswith("zipmoe_") and f"`{f}`" not in OPERATIONS}
    assert not undocumented


def test_kubernetes_probes_use_triton_health_endpoints_and_prometheus_scrapes_the_metrics_port():
    deployment, service = yaml.safe_load_all((REPO / "deploy" / "kubernetes.yaml").read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002, "openai": 9000}
    probes = {kind: container[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["startupProbe"] == {"path": "/v2/health/ready", "port": "http"}
    assert probes["readinessProbe"] == {"path": "/v2/models/mm_qa/ready", "port": "http"}  # 400 from a drain's start
    assert probes["livenessProbe"] == {"path": "/v2/health/live", "port": "http"}
    assert {p["name"] for p in service["spec"]["ports"]} == set(ports)
    scrape = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())["scrape_configs"]
    assert scrape[0]["static_configs"][0]["targets"] == ["localhost:8002"]
    assert {"regex": "metrics", "action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"]} \
        in scrape[1]["relabel_configs"]

"""deploy/ checked structurally: the Kubernetes manifests, the Prometheus
scrape config, the adapter rules and the Grafana dashboard parse; the
router's config in its Secret decodes as the router decodes it; probes and
scrapes use paths and ports the router and engine really serve (one
in-process router answers the probe paths); and every metric name in the
dashboard, the HPA and the adapter is declared in frontend/metric_names.py."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import yaml

from backends.mock import MockBackend, MockConfig
from frontend import metric_names as N
from router.app import OPS_PATHS, PROBE_PATHS, NamedBackend, Router
from router.config import RouterConfig, decode_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def docs(name: str) -> list[dict[str, Any]]:
    found = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d is not None]
    for d in found:
        assert {"apiVersion", "kind", "metadata"} <= d.keys() and d["metadata"].get("name"), d
    return found


def one(found: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    match = [d for d in found if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(match) == 1, (kind, name)
    return match[0]


def metric_names_in(expr: str) -> set[str]:
    """Every headrace_* series an expression reads, mapped to its family
    (a sample suffix must fit the family's type)."""
    names = set()
    for series in re.findall(r"\bheadrace_[a-z0-9_]+", expr):
        family = next((series.removesuffix(s) for s in ("_bucket", "_sum", "_count", "_total") if series.removesuffix(s) in N.FAMILIES), series)
        assert family in N.FAMILIES, f"{series} (in {expr!r}) is not declared in frontend/metric_names.py"
        suffix = series[len(family):]
        assert suffix in SUFFIXES[N.FAMILIES[family].type], f"{series}: a {N.FAMILIES[family].type} has no {suffix!r} series"
        names.add(family)
    return names


def router_config() -> tuple[RouterConfig, dict[str, Any]]:
    secret = one(docs("router.yaml"), "Secret", "headrace-router-config")
    raw = tomllib.loads(secret["stringData"]["router.toml"])
    return decode_config(raw), raw


def container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]  # type: ignore[no-any-return]


def port_number(c: dict[str, Any], port: str | int) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in c["ports"] if p["name"] == port)


def test_the_router_deployment_probes_the_main_listener_on_its_probe_paths() -> None:
    config, _ = router_config()
    deployment = one(docs("router.yaml"), "Deployment", "headrace-router")
    c = container(deployment)
    ready, live = c["readinessProbe"]["httpGet"], c["livenessProbe"]["httpGet"]
    assert (ready["path"], live["path"]) == ("/ready", "/health")
    assert {ready["path"], live["path"]} <= PROBE_PATHS  # served on the main listener, no key
    assert port_number(c, ready["port"]) == port_number(c, live["port"]) == config.server.port
    assert port_number(c, "admin") == config.server.admin_port
    assert config.server.host == config.server.admin_host == "0.0.0.0"
    assert config.auth.admin_sha256 is not None  # a non-loopback admin listener needs the admin key
    assert c["args"] == ["--config", "/etc/headrace/router.toml"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts["/etc/headrace"] == "config"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["terminationGracePeriodSeconds"] > config.server.drain_timeout
    # each router process sizes the whole fleet from its share of the traffic
    assert config.capacity.traffic_share == pytest.approx(1 / (deployment["spec"]["replicas"] * (config.server.workers or 0)))
    assert deployment["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_services_select_their_pods_and_target_named_ports() -> None:
    for file, workload_kind in (("router.yaml", "Deployment"), ("engine.yaml", "StatefulSet")):
        found = docs(file)
        workload = one(found, workload_kind)
        labels = workload["spec"]["template"]["metadata"]["labels"]
        names = {p["name"] for p in container(workload)["ports"]}
        for service in (d for d in found if d["kind"] == "Service"):
            assert service["spec"]["selector"].items() <= labels.items()
            assert {p["targetPort"] for p in service["spec"]["ports"]} <= names


def test_the_engine_statefulset_requests_a_gpu_and_is_what_the_router_lists() -> None:
    found = docs("engine.yaml")
    sts = one(found, "StatefulSet", "headrace-engine")
    c = container(sts)
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"  # the shared frontend's
    port = port_number(c, "http")
    assert c["args"][c["args"].index("--port") + 1] == str(port)
    headless = one(found, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    config, _ = router_config()
    urls = [b.url for b in config.backends]
    assert urls == [f"http://{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:{port}" for i in range(sts["spec"]["replicas"])]
    assert all(b.kind == "engine" for b in config.backends)


def test_the_hpa_scales_the_engines_on_the_desired_replicas_metric() -> None:
    hpa = one(docs("hpa.yaml"), "HorizontalPodAutoscaler")
    sts = one(docs("engine.yaml"), "StatefulSet")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": sts["metadata"]["name"]}
    (metric,) = hpa["spec"]["metrics"]
    ext = metric["external"]
    assert metric["type"] == "External" and ext["metric"]["name"] == N.DESIRED_REPLICAS.name
    assert set(ext["metric"]["selector"]["matchLabels"]) <= set(N.DESIRED_REPLICAS.labels)
    assert ext["target"] == {"type": "AverageValue", "averageValue": "1"}  # desired = the metric's value
    config, _ = router_config()
    model = ext["metric"]["selector"]["matchLabels"]["model"]
    assert model in {m.name for m in config.models}  # a label value the router exports
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    adapter = yaml.safe_load(one(docs("prometheus-adapter.yaml"), "ConfigMap")["data"]["config.yaml"])
    (rule,) = adapter["externalRules"]
    assert rule["name"]["as"] == N.DESIRED_REPLICAS.name
    assert metric_names_in(rule["seriesQuery"]) == metric_names_in(rule["metricsQuery"]) == {N.DESIRED_REPLICAS.name}
    assert rule["metricsQuery"].startswith("avg by (model)")  # every process's answer is for the whole fleet


def test_prometheus_scrapes_the_routers_admin_port_and_the_engines_port() -> None:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in doc["scrape_configs"]}
    assert set(jobs) == {"headrace-router", "headrace-engine"}
    router_c = container(one(docs("router.yaml"), "Deployment"))
    engine_c = container(one(docs("engine.yaml"), "StatefulSet"))
    for job, c, port, app in (("headrace-router", router_c, "admin", "headrace-router"), ("headrace-engine", engine_c, "http", "headrace-engine")):
        j = jobs[job]
        assert j["metrics_path"] == "/metrics"
        keep = {tuple(r["source_labels"]): r["regex"] for r in j["relabel_configs"] if r.get("action") == "keep"}
        assert keep[("__meta_kubernetes_pod_container_port_name",)] == port and port in {p["name"] for p in c["ports"]}
        assert keep[("__meta_kubernetes_pod_label_app_kubernetes_io_name",)] == app
    assert "/metrics" in OPS_PATHS - PROBE_PATHS  # admin listener only: the main port would 404


def test_the_dashboard_has_the_sli_panels_and_reads_only_declared_metrics() -> None:
    dash = json.loads((DEPLOY / "grafana" / "headrace.json").read_text())
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    used: set[str] = set()
    titles = []
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        assert panel["type"] == "timeseries" and {"h", "w", "x", "y"} <= panel["gridPos"].keys()
        titles.append(panel["title"])
        assert panel["targets"]
        for target in panel["targets"]:
            used |= metric_names_in(target["expr"])
    for variable in dash["templating"]["list"]:
        if variable["type"] == "query":
            used |= metric_names_in(variable["definition"])
    for wanted in ("time to first token", "inter-token", "queue time", "Rejections", "Migrations", "GPU utilisation", "KV cache", "Desired"):
        assert any(wanted in t for t in titles), wanted
    for family in (N.REQUEST_TTFT, N.REQUEST_ITL, N.REQUEST_QUEUE, N.PIPELINE_REJECTED, N.MIGRATIONS, N.BACKEND_MIGRATIONS, N.BACKEND_RETRIES, N.GPU_UTILIZATION,
                   N.ENGINE_KV_USAGE, N.DESIRED_REPLICAS, N.BREAKER_STATE, N.EJECTIONS, N.QUEUE_DEPTH):  # fmt: skip
        assert family.name in used, family.name


def test_the_dockerfile_builds_both_images_as_an_unprivileged_user() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.split(r"(?m)^FROM ", text)[1:]
    named = {re.match(r"\S+ AS (\w+)", s).group(1): s for s in stages}  # type: ignore[union-attr]
    assert set(named) == {"build", "router", "engine"}
    for name, port in (("router", "8000 8001"), ("engine", "8200")):
        stage = named[name]
        assert "COPY --from=build" in stage
        user = re.search(r"(?m)^USER (\S+)", stage)
        assert user is not None and user.group(1).split(":")[0] not in ("0", "root")
        assert re.search(rf"(?m)^EXPOSE {port}$", stage)
        assert f'ENTRYPOINT ["headrace", "{"serve" if name == "router" else "engine"}"]' in stage
    config, _ = router_config()
    assert f"EXPOSE {config.server.port} {config.server.admin_port}" in named["router"]
    assert "torch" in named["build"]  # the router's requirements leave it out


@pytest.mark.parametrize("path", sorted(PROBE_PATHS))
async def test_the_probe_paths_answer_on_the_routers_main_listener_app(path: str) -> None:
    router = Router(decode_config({}), [NamedBackend("mock-0", MockBackend(MockConfig(name="mock-0")))])
    async with trio.open_nursery() as nursery:
        await nursery.start(router.run)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router.public), base_url="http://r") as client:
            assert (await client.get(path)).status_code == 200
            assert (await client.get("/metrics")).status_code == 404  # not on the main listener
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router.admin), base_url="http://r") as client:
            assert (await client.get("/metrics")).status_code == 200
        nursery.cancel_scope.cancel()

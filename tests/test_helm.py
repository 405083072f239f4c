"""The Helm chart (helm/radixgate) and the Prometheus rules (configs/prometheus-rules.yaml).

The chart is linted and rendered offline with Helm's own Go code (helm-python-sdk), every
manifest is validated against the Kubernetes schemas (kubernetes-validate, bundled schemas),
and the wiring a fleet depends on is checked: the routers' worker URLs are the workers' stable
DNS names and equal what each worker advertises in its KV events, the rendered args parse with
the real CLIs, GPU requests, Redis, model volume, admin token, Prometheus scraping. Neither
package needs a helm binary or network at run time.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk not installed (pip install -e '.[test]')")
kube_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate not installed (pip install -e '.[test]')"
)

from router.config import build_config  # noqa: E402
from worker.config import ENV_PREFIX as WORKER_ENV_PREFIX  # noqa: E402
from worker.config import parse_args as parse_worker_args  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "radixgate"
CPU_VALUES = CHART / "values-cpu.yaml"
RULES = ROOT / "configs" / "prometheus-rules.yaml"
KUBE_VERSION = "1.30"  # the chart asks for >= 1.25; 1.30 is a supported release with its schemas bundled
RELEASE, NAMESPACE = "rg", "llm"
GPU = "nvidia.com/gpu"


# ------------------------------------------------------------------------------------ helpers
def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _profile_values(profile: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    base = yaml.safe_load(CPU_VALUES.read_text()) if profile == "cpu" else {}
    return _deep_merge(base, overrides or {})


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart, profile: str = "default", **overrides: Any) -> list[dict[str, Any]]:
    """Render with a profile plus overrides; returns every Kubernetes object as a dict."""
    manifests = chart.render(_profile_values(profile, overrides), name=RELEASE, namespace=NAMESPACE)
    objects = []
    for path, text in sorted(manifests.items()):
        if not path.endswith(".yaml"):
            continue  # NOTES.txt
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def one(objects: list[dict[str, Any]], kind: str, component: str | None = None) -> dict[str, Any]:
    found = [
        o
        for o in objects
        if o["kind"] == kind
        and (component is None or o["metadata"]["labels"].get("app.kubernetes.io/component") == component)
    ]
    assert len(found) == 1, f"expected one {kind} {component or ''}, got {len(found)}"
    return found[0]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def flag(args: list[str], name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` in an args list; None when absent."""
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def env_secret_refs(c: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {
        e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


def worker_argv(sts: dict[str, Any], ordinal: int) -> list[str]:
    """The worker's argv as Kubernetes hands it over: $(POD_NAME) expanded for one pod."""
    c = container(sts)
    pod_name_env = next(e for e in c["env"] if e["name"] == "POD_NAME")
    assert pod_name_env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    pod = f"{sts['metadata']['name']}-{ordinal}"
    return [a.replace("$(POD_NAME)", pod) for a in c["args"]]


# Values that switch on every optional object, so the schema check sees them all.
EVERYTHING = {
    "adminToken": {"value": "s3cret"},
    "model": {"source": "pvc", "dir": "llama", "pvc": {"claimName": "models"}},
    "router": {
        "tokenizer": "model",
        "config": {
            "breaker_open_s": 5.0,
            "affinity_groups": [{"name": "acme", "match": {"header": {"x-tenant": "acme"}}, "share": 0.25}],
        },
        "policyParams": {"balance_abs": 4},
        "discovery": "kubernetes",
    },
    "metrics": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "grafanaDashboard": {"enabled": True},
    },
    "networkPolicy": {"enabled": True},
    "worker": {"flags": {"max-running": 128}, "podAnnotations": {"team": "ml"}},
}


# ------------------------------------------------------------------------------- lint, schemas
@pytest.mark.parametrize(("profile", "overrides"), [("default", {}), ("cpu", {}), ("default", EVERYTHING)],
                         ids=["default", "cpu", "everything-on"])  # fmt: skip
def test_chart_lints_without_warnings(profile: str, overrides: dict) -> None:
    values = _profile_values(profile, overrides)
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 = warning, 3 = error
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize(
    ("profile", "overrides"),
    [("default", {}), ("cpu", {}), ("default", EVERYTHING), ("cpu", {"redis": {"enabled": False}})],
    ids=["default", "cpu", "everything-on", "cpu-no-redis"],
)
def test_every_manifest_validates_against_kubernetes_schemas(chart, profile: str, overrides: dict) -> None:
    objects = render(chart, profile, **overrides)
    errors = []
    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        assert obj["metadata"]["namespace"] == NAMESPACE, where
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no bundled schema; checked by test_service_monitors_select_the_services
        try:
            kube_validate.validate(obj, KUBE_VERSION, strict=True)
        except kube_validate.ValidationError as exc:
            errors.append(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")
    assert errors == []
    kinds = sorted(o["kind"] for o in objects)
    expected = [
        "Deployment",
        "Deployment",
        "PodDisruptionBudget",
        "Service",
        "Service",
        "Service",
        "StatefulSet",
    ]
    if overrides.get("redis", {}).get("enabled") is False:
        expected = ["Deployment", "PodDisruptionBudget", "Service", "Service", "StatefulSet"]
    if overrides is EVERYTHING:
        expected = sorted([*expected, "ConfigMap", "ConfigMap", "NetworkPolicy", "NetworkPolicy", "Secret",
                           "ServiceMonitor", "ServiceMonitor", "Role", "RoleBinding", "ServiceAccount"])  # fmt: skip
    assert kinds == expected


# -------------------------------------------------------------------- router <-> worker wiring
@pytest.mark.parametrize(("profile", "replicas"), [("default", 2), ("cpu", 1), ("cpu", 5)])
def test_router_addresses_each_worker_by_its_stable_dns_name(chart, profile: str, replicas: int) -> None:
    objects = render(chart, profile, worker={"replicas": replicas})
    sts = one(objects, "StatefulSet", "worker")
    headless = next(
        o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == sts["spec"]["serviceName"]
    )
    assert headless["spec"]["clusterIP"] == "None"
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= pod_labels.items()
    port = container(sts)["ports"][0]["containerPort"]
    assert headless["spec"]["ports"][0]["port"] == port

    router = build_config(container(one(objects, "Deployment", "router"))["args"], environ={})
    expected = [
        f"http://{sts['metadata']['name']}-{i}.{headless['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{port}"
        for i in range(replicas)
    ]
    assert router.workers == expected
    assert (router.host, router.port) == ("0.0.0.0", 8000)
    assert sts["spec"]["replicas"] == replicas
    # NOTE: the router matches KV event batches to workers by the advertised URL.
    for i, url in enumerate(expected):
        worker = parse_worker_args(worker_argv(sts, i))
        assert worker.resolved_advertise_url() == url
        assert (worker.host, worker.port) == ("0.0.0.0", port)


def test_router_service_pdb_and_probes_target_the_router_pods(chart) -> None:
    objects = render(chart, router={"replicas": 3, "pdb": {"minAvailable": 2}})
    deploy = one(objects, "Deployment", "router")
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert deploy["spec"]["replicas"] == 3
    service = one(objects, "Service", "router")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    pdb = one(objects, "PodDisruptionBudget", "router")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"] == {**pdb["spec"], "minAvailable": 2} and "maxUnavailable" not in pdb["spec"]
    c = container(deploy)
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    start = c["startupProbe"]  # NOTE: liveness waits for it: a slow first listing is not a dead router
    assert start["httpGet"]["path"] == "/health" and start["periodSeconds"] * start["failureThreshold"] >= 60
    assert c["resources"]["requests"]["cpu"]
    assert {p["name"] for p in c["ports"]} == {"http"}


# ----------------------------------------------------------------------------------------- GPU
def test_gpu_is_requested_by_default_and_only_by_workers(chart) -> None:
    objects = render(chart, worker={"gpu": {"count": 2}})
    c = container(one(objects, "StatefulSet", "worker"))
    assert c["resources"]["limits"][GPU] == 2 and c["resources"]["requests"][GPU] == 2
    assert c["resources"]["requests"]["memory"] == "32Gi"  # the rest of worker.resources is kept
    assert flag(c["args"], "--device") == "cuda"
    router_and_redis = [o for o in objects if o["kind"] == "Deployment"]
    assert GPU not in yaml.safe_dump(router_and_redis)


def test_tensor_parallel_workers_request_a_gpu_per_rank(chart) -> None:
    objects = render(chart, worker={"tensorParallelSize": 4})
    sts = one(objects, "StatefulSet", "worker")
    c = container(sts)
    assert c["resources"]["limits"][GPU] == 4 and c["resources"]["requests"][GPU] == 4
    assert parse_worker_args(worker_argv(sts, 0)).tensor_parallel_size == 4
    c = container(
        one(render(chart, worker={"tensorParallelSize": 2, "gpu": {"count": 8}}), "StatefulSet", "worker")
    )
    assert c["resources"]["limits"][GPU] == 8  # more GPUs than ranks asked for: kept
    assert "--tensor-parallel-size" not in container(one(render(chart), "StatefulSet", "worker"))["args"]


def test_cpu_profile_requests_no_gpu(chart) -> None:
    objects = render(chart, "cpu")
    assert GPU not in yaml.safe_dump(objects)
    sts = one(objects, "StatefulSet", "worker")
    worker = parse_worker_args(worker_argv(sts, 0))
    assert (worker.device, worker.model, worker.kv_cache_tokens) == ("cpu", "tiny", 65536)


def test_on_and_off_in_a_values_file_reach_the_programs_as_on_and_off(chart) -> None:
    """A values file's unquoted on / off are YAML 1.1 booleans (Helm's reading, as yaml.safe_load's
    here): they render as the words the flags take, not true / false, which both programs refuse."""
    values = yaml.safe_load("router: {kvEvents: off}\nworker: {flags: {overlap-schedule: off, "
                            "cuda-graph-extend-variants: on}}\n")  # fmt: skip
    assert values["router"]["kvEvents"] is False
    objects = render(chart, "cpu", **values)
    router = container(one(objects, "Deployment", "router"))["args"]
    assert flag(router, "--kv-events") == "off"
    args = container(one(objects, "StatefulSet", "worker"))["args"]
    assert "--overlap-schedule=off" in args and "--cuda-graph-extend-variants=on" in args
    worker = parse_worker_args(worker_argv(one(objects, "StatefulSet", "worker"), 0))
    assert (worker.overlap_schedule, worker.cuda_graph_extend_variants) == ("off", "on")
    with pytest.raises(Exception, match="kvEvents: true"):
        render(chart, "cpu", router={"kvEvents": True})
    for workload in (one(objects, "Deployment", "router"), one(objects, "StatefulSet", "worker")):
        assert workload["spec"]["template"]["spec"]["enableServiceLinks"] is False  # see the template


def test_worker_flags_keep_whole_numbers_whole(chart) -> None:
    objects = render(chart, "cpu", worker={"flags": {"stream-maxlen": 1000000, "mem-fraction": 0.9}})
    args = container(one(objects, "StatefulSet", "worker"))["args"]
    assert "--stream-maxlen=1000000" in args and "--mem-fraction=0.9" in args
    worker = parse_worker_args(worker_argv(one(objects, "StatefulSet", "worker"), 0))
    assert (worker.stream_maxlen, worker.mem_fraction) == (1_000_000, 0.9)


def test_workers_end_requests_in_flight_before_the_pods_grace_period_ends(chart) -> None:
    """At SIGTERM a worker lets requests in flight run 5 s less than Kubernetes waits before it kills the
    pod, so each one left then is answered (a 503) rather than cut; a short grace period gives 0."""
    for grace, expected in ((30, 25.0), (60, 55.0), (3, 0.0)):
        objects = render(chart, "cpu", worker={"terminationGracePeriodSeconds": grace})
        sts = one(objects, "StatefulSet", "worker")
        assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == grace
        assert parse_worker_args(worker_argv(sts, 0)).shutdown_timeout_s == expected


def test_routers_leave_rotation_before_they_stop_within_their_grace_period(chart) -> None:
    """At SIGTERM a router serves on --shutdown-delay-s (router.shutdownDelaySeconds) with /ready 503,
    inside its pod's grace period; a delay that would use the whole period is refused."""
    deploy = one(render(chart, "cpu"), "Deployment", "router")
    assert deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 60
    assert build_config(container(deploy)["args"], environ={}).shutdown_delay_s == 5.0
    deploy = one(render(chart, "cpu", router={"shutdownDelaySeconds": 0}), "Deployment", "router")
    assert build_config(container(deploy)["args"], environ={}).shutdown_delay_s == 0.0
    with pytest.raises(helm.HelmRenderError, match="shutdownDelaySeconds must be below"):
        render(chart, "cpu", router={"shutdownDelaySeconds": 30, "terminationGracePeriodSeconds": 30})


# --------------------------------------------------------------------------------------- Redis
def test_bundled_redis_is_used_by_routers_and_workers(chart) -> None:
    objects = render(chart, "cpu")
    service = one(objects, "Service", "redis")
    one(objects, "Deployment", "redis")
    url = f"redis://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}/0"
    assert flag(container(one(objects, "Deployment", "router"))["args"], "--redis-url") == url
    assert flag(container(one(objects, "StatefulSet", "worker"))["args"], "--redis-url") == url


def _bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (2Gi) or a Redis one (1536mb) in bytes."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "kb": 2**10, "mb": 2**20, "gb": 2**30}
    for unit, scale in units.items():
        if quantity.endswith(unit):
            return int(quantity[: -len(unit)]) * scale
    return int(quantity)


@pytest.mark.parametrize("profile", ["default", "cpu"])
def test_bundled_redis_holds_the_workers_streams_within_its_memory_limit(chart, profile: str) -> None:
    """The workers' streams (--stream-maxlen entries of ~30 KiB: a batch caching a 4,000-token prompt of a
    128k vocabulary) fit Redis' maxmemory, and that stays below the container's limit: past it Redis evicts
    a stream (a gap routers re-sync from) instead of being OOM-killed (100,000 entries: ~2.9 GiB)."""
    objects = render(chart, profile)
    redis = container(one(objects, "Deployment", "redis"))
    maxmemory = _bytes(flag(redis["args"], "--maxmemory"))
    assert flag(redis["args"], "--maxmemory-policy") == "allkeys-lru"
    assert maxmemory <= 0.65 * _bytes(redis["resources"]["limits"]["memory"])  # NOTE: RSS ~1.3x used memory
    worker = parse_worker_args(worker_argv(one(objects, "StatefulSet", "worker"), 0))
    assert worker.stream_maxlen * 30 * 2**10 <= maxmemory


def test_disabling_bundled_redis_drops_it_and_uses_the_external_url(chart) -> None:
    external = "redis://redis.shared.svc:6379/3"
    objects = render(chart, "cpu", redis={"enabled": False, "externalUrl": external})
    assert not [o for o in objects if o["metadata"]["labels"].get("app.kubernetes.io/component") == "redis"]
    router = build_config(container(one(objects, "Deployment", "router"))["args"], environ={})
    assert router.redis_url == external
    worker = parse_worker_args(worker_argv(one(objects, "StatefulSet", "worker"), 0))
    assert worker.redis_url == external


def test_no_redis_at_all_means_http_event_streams(chart) -> None:
    objects = render(chart, "cpu", redis={"enabled": False})
    router = build_config(container(one(objects, "Deployment", "router"))["args"], environ={})
    assert router.redis_url is None and router.kv_events == "auto"
    assert flag(container(one(objects, "StatefulSet", "worker"))["args"], "--redis-url") is None


def test_redis_url_with_credentials_comes_from_a_secret(chart) -> None:
    objects = render(chart, "cpu", redis={"enabled": False, "urlSecret": {"name": "redis-creds"}})
    router_c = container(one(objects, "Deployment", "router"))
    worker_c = container(one(objects, "StatefulSet", "worker"))
    assert flag(router_c["args"], "--redis-url") is None and flag(worker_c["args"], "--redis-url") is None
    assert env_secret_refs(router_c)["RADIXGATE_REDIS_URL"] == ("redis-creds", "url")
    assert env_secret_refs(worker_c)[WORKER_ENV_PREFIX + "REDIS_URL"] == ("redis-creds", "url")


def test_external_redis_with_the_bundled_one_on_is_refused(chart) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape("redis.enabled=false")):
        render(chart, redis={"externalUrl": "redis://elsewhere:6379/0"})


# ------------------------------------------------------------------------ model, secret, config
def test_model_from_a_pvc_is_mounted_in_workers_and_routers(chart) -> None:
    overrides = copy.deepcopy(EVERYTHING)
    del overrides["router"]["config"]  # the router's args then parse without the mounted file
    objects = render(chart, **overrides)
    sts = one(objects, "StatefulSet", "worker")
    worker = parse_worker_args(worker_argv(sts, 0))
    assert worker.model == "/models/llama"
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in container(sts)["volumeMounts"]
    deploy = one(objects, "Deployment", "router")
    assert build_config(container(deploy)["args"], environ={}).tokenizer == "/models/llama"
    router_volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    assert router_volumes["model"] == volumes["model"]


def test_model_from_a_host_path(chart) -> None:
    objects = render(chart, model={"source": "hostPath", "hostPath": {"path": "/data/llama-3-8b"}})
    sts = one(objects, "StatefulSet", "worker")
    assert flag(container(sts)["args"], "--model") == "/models"
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["hostPath"] == {"path": "/data/llama-3-8b", "type": "Directory"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model": {"source": "pvc"}}, "claimName"),
        ({"model": {"source": "s3"}}, "model.source"),
        ({"router": {"tokenizer": "model"}}, "router.tokenizer=model"),
    ],
)
def test_incomplete_model_settings_fail_to_render(chart, overrides: dict, message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render(chart, **overrides)


def test_admin_token_reaches_router_and_workers_from_a_secret(chart) -> None:
    objects = render(chart, "cpu", adminToken={"value": "s3cret"})
    secret = one(objects, "Secret")
    name = secret["metadata"]["name"]
    router_refs = env_secret_refs(container(one(objects, "Deployment", "router")))
    worker_refs = env_secret_refs(container(one(objects, "StatefulSet", "worker")))
    assert router_refs["RADIXGATE_ADMIN_TOKEN"] == (name, "token")
    assert worker_refs[WORKER_ENV_PREFIX + "ADMIN_TOKEN"] == (name, "token")
    assert build_config([], environ={"RADIXGATE_ADMIN_TOKEN": "s3cret"}).admin_token == "s3cret"

    objects = render(chart, "cpu", adminToken={"existingSecret": "ops-token", "secretKey": "t"})
    assert not [o for o in objects if o["kind"] == "Secret"]
    assert env_secret_refs(container(one(objects, "Deployment", "router")))["RADIXGATE_ADMIN_TOKEN"] == (
        "ops-token",
        "t",
    )
    objects = render(chart, "cpu")
    assert "RADIXGATE_ADMIN_TOKEN" not in env_secret_refs(container(one(objects, "Deployment", "router")))


def test_router_config_is_a_valid_router_yaml(chart, tmp_path: Path) -> None:
    objects = render(chart, **EVERYTHING)
    cm = one(objects, "ConfigMap", "router")
    config_file = tmp_path / "router.yaml"
    config_file.write_text(cm["data"]["router.yaml"])
    deploy = one(objects, "Deployment", "router")
    args = container(deploy)["args"]
    assert flag(args, "--config") == "/etc/radixgate/router.yaml"
    mounts = {m["name"]: m["mountPath"] for m in container(deploy)["volumeMounts"]}
    assert mounts["config"] == "/etc/radixgate"
    local_args = [str(config_file) if a == "/etc/radixgate/router.yaml" else a for a in args]
    router = build_config(local_args, environ={})
    assert router.breaker_open_s == 5.0 and router.policy_params == {"balance_abs": 4}
    assert router.affinity_groups[0]["name"] == "acme"  # validated by build_config on the way
    assert "checksum/config" in deploy["spec"]["template"]["metadata"]["annotations"]


# ------------------------------------------------------------------------------------- metrics
def test_pods_carry_prometheus_scrape_annotations(chart) -> None:
    objects = render(chart)
    for kind, component in (("Deployment", "router"), ("StatefulSet", "worker")):
        workload = one(objects, kind, component)
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        port = container(workload)["ports"][0]["containerPort"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == (
            str(port),
            "/metrics",
        )
    objects = render(chart, metrics={"podAnnotations": False})
    for kind, component in (("Deployment", "router"), ("StatefulSet", "worker")):
        assert "annotations" not in one(objects, kind, component)["spec"]["template"]["metadata"]


def test_service_monitors_select_the_services(chart) -> None:
    assert not [o for o in render(chart) if o["kind"] == "ServiceMonitor"]
    objects = render(chart, **EVERYTHING)
    for component in ("router", "worker"):
        monitor = one(objects, "ServiceMonitor", component)
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        service = one(objects, "Service", component)
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
        assert endpoint["path"] == "/metrics"
    redis_service = one(objects, "Service", "redis")
    for monitor in (o for o in objects if o["kind"] == "ServiceMonitor"):
        assert (
            not monitor["spec"]["selector"]["matchLabels"].items()
            <= redis_service["metadata"]["labels"].items()
        )


# ---------------------------------------------------------------------------- Prometheus rules
REQUIRED_ALERTS = {
    "RadixgateNoHealthyWorkers",
    "RadixgateWorkerBreakerOpen",
    "RadixgateHigh5xxRate",
    "RadixgateHitRatePredictionGap",
    "RadixgateWorkerKVUsageHigh",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"}
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _documented_metrics() -> set[str]:
    text = (ROOT / "docs" / "metrics.md").read_text() + (ROOT / "docs" / "worker.md").read_text()
    return set(re.findall(r"`(radixgate_[a-z0-9_]+)", text))


def test_rules_file_has_the_expected_structure() -> None:
    doc = yaml.safe_load(RULES.read_text())
    names = [g["name"] for g in doc["groups"]]
    assert len(names) == len(set(names)) and all(g["rules"] for g in doc["groups"])
    records, alerts = set(), set()
    for rule in _rules():
        assert ("record" in rule) != ("alert" in rule), rule
        assert isinstance(rule["expr"], str) and rule["expr"].strip()
        assert rule["expr"].count("(") == rule["expr"].count(")")
        if "record" in rule:
            assert re.fullmatch(r"radixgate:[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule["record"]
            records.add(rule["record"])
        else:
            alerts.add(rule["alert"])
            assert re.fullmatch(r"\d+[smh]", rule["for"])
            assert rule["labels"]["severity"] in {"warning", "critical"}
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    assert alerts >= REQUIRED_ALERTS
    assert "radixgate:fleet_hit_rate_actual:ratio_rate5m" in records
    used = {name for rule in _rules() for name in re.findall(r"radixgate:[a-z0-9_:]+", rule["expr"])}
    assert used <= records, f"recording rules used but not defined: {used - records}"


def test_rules_reference_only_documented_metrics() -> None:
    documented = _documented_metrics()
    assert "radixgate_worker_kv_usage" in documented and "radixgate_requests_total" in documented
    unknown = set()
    for rule in _rules():
        text = rule["expr"] + " ".join(rule.get("annotations", {}).values())
        for name in re.findall(r"(?<![a-z0-9_:])radixgate_[a-z0-9_]+", text):
            base = next((name[: -len(s)] for s in HISTOGRAM_SUFFIXES if name.endswith(s)), name)
            if name not in documented and base not in documented:
                unknown.add(name)
    assert unknown == set()


PROMTOOL_TESTS = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # router r1: worker a healthy, b down; router r2: no workers registered at all
      - series: 'radixgate_upstream_healthy{{namespace="llm",instance="r1",worker="http://a"}}'
        values: '1x20'
      - series: 'radixgate_upstream_healthy{{namespace="llm",instance="r1",worker="http://b"}}'
        values: '0x20'
      - series: 'radixgate_workers{{namespace="llm",instance="r1"}}'
        values: '2x20'
      - series: 'radixgate_workers{{namespace="llm",instance="r2"}}'
        values: '0x20'
      - series: 'radixgate_upstream_breaker_state{{namespace="llm",instance="r1",worker="http://b"}}'
        values: '0 1 1 2 1 1 1 1 1 1 1'
      # 1000 prompt tokens/min, 600 cached in usage, 900 predicted: actual 0.6, predicted 0.9
      - series: 'radixgate_upstream_usage_prompt_tokens_total{{namespace="llm",worker="http://a"}}'
        values: '0+6000x30'
      - series: 'radixgate_upstream_cached_tokens_total{{namespace="llm",worker="http://a"}}'
        values: '0+3600x30'
      - series: 'radixgate_upstream_prompt_tokens_total{{namespace="llm",worker="http://a"}}'
        values: '0+6000x30'
      - series: 'radixgate_upstream_predicted_cached_tokens_total{{namespace="llm",worker="http://a"}}'
        values: '0+5400x30'
      # the worker's own series of the same names (no worker label) must not count
      - series: 'radixgate_worker_cached_tokens_total{{namespace="llm",instance="w0"}}'
        values: '0+6000x30'
      - series: 'radixgate_worker_prompt_tokens_total{{namespace="llm",instance="w0"}}'
        values: '0+6000x30'
      - series: 'radixgate_requests_total{{namespace="llm",endpoint="chat",status="200"}}'
        values: '0+540x30'
      - series: 'radixgate_requests_total{{namespace="llm",endpoint="chat",status="503"}}'
        values: '0+60x30'
      - series: 'radixgate_requests_total{{namespace="llm",endpoint="chat",status="429"}}'
        values: '0+60x30'
      # namespace quota: every 429 is an API key over its own rate limit, no capacity problem
      - series: 'radixgate_requests_total{{namespace="quota",endpoint="chat",status="429"}}'
        values: '0+60x30'
      - series: 'radixgate_api_key_requests_total{{namespace="quota",key="batch",outcome="rate_limited"}}'
        values: '0+60x30'
      - series: 'radixgate_worker_kv_usage{{namespace="llm",instance="w0"}}'
        values: '0.95x20'
      - series: 'radixgate_worker_kv_usage{{namespace="llm",instance="w1"}}'
        values: '0.5x20'
      # namespace llm: 10 KV fetches a minute ok, 5 busy, 15 wasted, 5 error (71% for nothing; 29%
      # without the wasted ones); ns ok: 1 busy in 10
      - series: 'radixgate_worker_kv_fetch_total{{namespace="llm",instance="w0",outcome="ok"}}'
        values: '0+10x40'
      - series: 'radixgate_worker_kv_fetch_total{{namespace="llm",instance="w0",outcome="busy"}}'
        values: '0+5x40'
      - series: 'radixgate_worker_kv_fetch_total{{namespace="llm",instance="w0",outcome="wasted"}}'
        values: '0+15x40'
      - series: 'radixgate_worker_kv_fetch_total{{namespace="llm",instance="w1",outcome="error"}}'
        values: '0+5x40'
      - series: 'radixgate_worker_kv_fetch_total{{namespace="ok",instance="w2",outcome="ok"}}'
        values: '0+9x40'
      - series: 'radixgate_worker_kv_fetch_total{{namespace="ok",instance="w2",outcome="busy"}}'
        values: '0+1x40'
      # router r1 lists every 5 s (12 a minute) and every listing fails; r2 fails one in twelve
      - series: 'radixgate_discovery_rounds_total{{namespace="llm",instance="r1"}}'
        values: '0+12x30'
      - series: 'radixgate_discovery_failures_total{{namespace="llm",instance="r1"}}'
        values: '0+12x30'
      - series: 'radixgate_discovery_rounds_total{{namespace="llm",instance="r2"}}'
        values: '0+12x30'
      - series: 'radixgate_discovery_failures_total{{namespace="llm",instance="r2"}}'
        values: '0+1x30'
    # Alerts are checked through the ALERTS series: alert_rule_test would also pin every
    # annotation's text.
    promql_expr_test:
      - expr: round(radixgate:fleet_hit_rate_actual:ratio_rate5m, 0.001)
        eval_time: 10m
        exp_samples: [{{labels: '{{namespace="llm"}}', value: 0.6}}]
      - expr: round(radixgate:fleet_hit_rate_predicted:ratio_rate5m, 0.001)
        eval_time: 10m
        exp_samples: [{{labels: '{{namespace="llm"}}', value: 0.9}}]
      - expr: ALERTS{{alertname="RadixgateNoHealthyWorkers", alertstate="firing"}}
        eval_time: 5m
        exp_samples:
          - labels: '{{__name__="ALERTS", alertname="RadixgateNoHealthyWorkers", alertstate="firing", severity="critical", namespace="llm", instance="r2"}}'
            value: 1
      - expr: ALERTS{{alertname="RadixgateWorkerBreakerOpen", alertstate="firing"}}
        eval_time: 5m
        exp_samples:
          - labels: '{{__name__="ALERTS", alertname="RadixgateWorkerBreakerOpen", alertstate="firing", severity="warning", namespace="llm", worker="http://b"}}'
            value: 1
      - expr: ALERTS{{alertname="RadixgateHigh5xxRate", alertstate="firing"}}
        eval_time: 20m
        exp_samples:
          - labels: '{{__name__="ALERTS", alertname="RadixgateHigh5xxRate", alertstate="firing", severity="critical", namespace="llm"}}'
            value: 1
      - expr: ALERTS{{alertname="RadixgateHitRatePredictionGap"}}
        eval_time: 10m
        exp_samples:
          - labels: '{{__name__="ALERTS", alertname="RadixgateHitRatePredictionGap", alertstate="pending", severity="warning", namespace="llm"}}'
            value: 1
      - expr: ALERTS{{alertname="RadixgateHitRatePredictionGap", alertstate="firing"}}
        eval_time: 25m
        exp_samples:
          - labels: '{{__name__="ALERTS", alertname="RadixgateHitRatePredictionGap", alertstate="firing", severity="warning", namespace="llm"}}'
            value: 1
      - expr: ALERTS{{alertname="RadixgateOutOfCapacity", alertstate="firing"}}
        eval_time: 15m
        exp_samples:
          - labels: '{{__name__="ALERTS", alertname="RadixgateOutOfCapacity", alertstate="firing", severity="warning", namespace="llm"}}'
            value: 1
      - expr: ALERTS{{alertname="RadixgateWorkerDiscoveryFailing", alertstate="firing"}}
        eval_time: 20m
        exp_samples:
          - labels: '{{__name__="ALERTS", alertname="RadixgateWorkerDiscoveryFailing", alertstate="firing", severity="warning", namespace="llm", instance="r1"}}'
            value: 1
      - expr: ALERTS{{alertname="RadixgateWorkerKVUsageHigh", alertstate="firing"}}
        eval_time: 15m
        exp_samples:
          - labels: '{{__name__="ALERTS", alertname="RadixgateWorkerKVUsageHigh", alertstate="firing", severity="warning", namespace="llm", instance="w0"}}'
            value: 1
      - expr: ALERTS{{alertname="RadixgateKVFetchesWasted", alertstate="firing"}}
        eval_time: 30m
        exp_samples:
          - labels: '{{__name__="ALERTS", alertname="RadixgateKVFetchesWasted", alertstate="firing", severity="warning", namespace="llm"}}'
            value: 1
"""


@pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool not on PATH (Prometheus' own tool, e.g. the Debian package 'prometheus'); "
    "the rules' PromQL is then checked only structurally",
)
def test_rules_pass_promtool_and_fire_on_synthetic_series(tmp_path: Path) -> None:
    check = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=30
    )
    assert check.returncode == 0, check.stdout + check.stderr
    tests = tmp_path / "rules_test.yaml"
    tests.write_text(PROMTOOL_TESTS.format(rules=RULES))
    result = subprocess.run(
        ["promtool", "test", "rules", str(tests)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_dashboard_ships_as_a_sidecar_configmap_when_asked(chart) -> None:
    assert not [
        o
        for o in render(chart)
        if o["kind"] == "ConfigMap" and "grafana_dashboard" in o["metadata"]["labels"]
    ]
    objects = render(
        chart, metrics={"grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM"}}}
    )
    (cm,) = [
        o for o in objects if o["kind"] == "ConfigMap" and "grafana_dashboard" in o["metadata"]["labels"]
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    shipped = json.loads(cm["data"]["radixgate.json"])
    assert shipped == json.loads((CHART / "dashboards" / "radixgate.json").read_text())
    assert shipped["uid"] == "radixgate" and len(shipped["panels"]) > 10


def test_client_api_keys_reach_only_the_routers_from_a_secret(chart) -> None:
    objects = render(chart)
    assert "RADIXGATE_API_KEYS" not in env_secret_refs(container(one(objects, "Deployment", "router")))
    objects = render(chart, router={"apiKeys": {"existingSecret": "client-keys", "secretKey": "list"}})
    router_env = env_secret_refs(container(one(objects, "Deployment", "router")))
    assert router_env["RADIXGATE_API_KEYS"] == ("client-keys", "list")
    assert "RADIXGATE_API_KEYS" not in env_secret_refs(container(one(objects, "StatefulSet", "worker")))
    environ = {"RADIXGATE_API_KEYS": "a, b"}
    assert build_config(["--workers", "http://w:8001"], environ=environ).api_keys == ["a", "b"]


def test_the_worker_api_key_reaches_routers_and_workers_under_one_name(chart, monkeypatch) -> None:
    objects = render(chart)
    assert "RADIXGATE_WORKER_API_KEY" not in env_secret_refs(container(one(objects, "StatefulSet", "worker")))
    objects = render(chart, workerApiKey={"existingSecret": "worker-key", "secretKey": "k"})
    for kind, name in (("Deployment", "router"), ("StatefulSet", "worker")):
        assert env_secret_refs(container(one(objects, kind, name)))["RADIXGATE_WORKER_API_KEY"] == (
            "worker-key",
            "k",
        )
    # the same variable means --worker-api-key to a router and --api-key to a worker
    environ = {"RADIXGATE_WORKER_API_KEY": "s3cret"}
    assert build_config(["--workers", "http://w:8001"], environ=environ).worker_api_key == "s3cret"
    monkeypatch.setenv("RADIXGATE_WORKER_API_KEY", "s3cret")
    assert parse_worker_args([]).api_key == "s3cret"


def test_kubernetes_discovery_lists_the_worker_service_with_a_namespaced_read_only_role(chart) -> None:
    static = container(one(render(chart), "Deployment", "router"))
    assert "--workers" in static["args"] and "--k8s-worker-service" not in static["args"]
    assert not [o for o in render(chart) if o["kind"] in ("Role", "RoleBinding", "ServiceAccount")]
    objects = render(chart, router={"discovery": "kubernetes", "discoveryIntervalS": 2})
    deployment = one(objects, "Deployment", "router")
    args = container(deployment)["args"]
    assert "--workers" not in args
    service = one(objects, "Service", "worker")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["ports"][0]["name"] == "http"
    flags = dict(zip(args[::2], args[1::2], strict=False))  # flag, value pairs
    assert flags["--k8s-worker-service"] == service["metadata"]["name"]
    assert flags["--k8s-worker-port-name"] == "http" and flags["--discovery-interval-s"] == "2"
    build_config(args)  # a router accepts them
    pod = deployment["spec"]["template"]["spec"]
    role, binding = one(objects, "Role", "router"), one(objects, "RoleBinding", "router")
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list"]}
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert (
        binding["subjects"][0]["name"]
        == pod["serviceAccountName"]
        == one(objects, "ServiceAccount", "router")["metadata"]["name"]
    )
    assert pod["automountServiceAccountToken"] is True


def notes(chart, **overrides: Any) -> str:
    """What `helm install` prints after installing (templates/NOTES.txt)."""
    manifests = chart.render(_profile_values("default", overrides), name=RELEASE, namespace=NAMESPACE)
    return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))


def test_notes_say_how_to_scale_workers_as_the_routers_find_them(chart) -> None:
    workers = f"{RELEASE}-radixgate-worker"
    worker_url = f"http://{workers}-1.{workers}.{NAMESPACE}.svc.cluster.local:8001"
    static = notes(chart)
    assert worker_url in static  # the rendered --workers list
    assert "helm upgrade --set worker.replicas=N`,\nnot `kubectl scale`" in static
    found = notes(chart, router={"discovery": "kubernetes", "discoveryIntervalS": 2})
    assert worker_url not in found and "helm upgrade --set worker.replicas" not in found
    assert f"endpoints of Service {workers} every\n2 s" in found
    assert f"kubectl -n {NAMESPACE} scale statefulset {workers} --replicas N" in found


def test_deploy_docs_list_every_kind_of_object_the_chart_creates(chart) -> None:
    everything = {"router": {"discovery": "kubernetes", "config": {"health_interval_s": 2}},
                  "adminToken": {"value": "t"}, "networkPolicy": {"enabled": True},
                  "metrics": {"serviceMonitor": {"enabled": True}, "grafanaDashboard": {"enabled": True}}}  # fmt: skip
    kinds = {o["kind"] for o in render(chart, **everything)}
    table = (ROOT / "docs" / "deploy.md").read_text().split("## What it creates")[1].split("\n## ")[0]
    documented = {word for line in table.splitlines() if line.startswith("| ")
                  for word in re.findall(r"[A-Za-z]+", line.split("|")[1])}  # fmt: skip
    assert kinds - documented == set()


def test_network_policy_lets_only_routers_workers_and_scrapers_reach_workers(chart) -> None:
    assert not [o for o in render(chart) if o["kind"] == "NetworkPolicy"]
    scraper = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    objects = render(chart, networkPolicy={"enabled": True, "metricsFrom": [scraper]})
    policies = {
        o["metadata"]["labels"]["app.kubernetes.io/component"]: o
        for o in objects
        if o["kind"] == "NetworkPolicy"
    }
    assert set(policies) == {"worker", "redis"}
    for component, policy in policies.items():
        kube_validate.validate(policy, KUBE_VERSION, strict=True)
        target = one(objects, "StatefulSet" if component == "worker" else "Deployment", component)
        pod_labels = target["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
        # the scrapers reach the workers (/metrics is on the API's port), not Redis (it has no metrics)
        rule, *scrapers = policy["spec"]["ingress"]
        allowed = [peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in rule["from"]]
        assert allowed == ["router", "worker"]
        assert scrapers == ([{"from": [scraper]}] if component == "worker" else [])
    assert "redis" not in {
        o["metadata"]["labels"]["app.kubernetes.io/component"]
        for o in render(chart, networkPolicy={"enabled": True}, redis={"enabled": False})
        if o["kind"] == "NetworkPolicy"
    }


def test_workers_take_kv_hints_unkeyed_only_behind_the_network_policy(chart) -> None:
    """A worker takes a KV source a request names from anyone (--kv-hints any) only where the network
    policy lets no one but routers and workers reach it; with a key it needs none (keyed)."""

    def hints(**values: Any) -> str | None:
        worker = container(one(render(chart, **values), "StatefulSet", "worker"))
        return {e["name"]: e.get("value") for e in worker["env"]}.get("RADIXGATE_WORKER_KV_HINTS")

    assert hints() is None
    assert hints(networkPolicy={"enabled": True}) == "any"
    keyed = {
        "networkPolicy": {"enabled": True},
        "workerApiKey": {"existingSecret": "keys", "secretKey": "key"},
    }
    assert hints(**keyed) is None
    # scrapers let in reach the workers' whole API (/metrics shares its port): hints then need the key
    scraper = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    assert hints(networkPolicy={"enabled": True, "metricsFrom": [scraper]}) is None


@pytest.mark.parametrize("tag", [2, 20240101, "1.0", "v0.4.1"])
def test_an_image_tag_yaml_reads_as_a_number_is_its_digits(chart, tag) -> None:
    """``--set image.tag=20240101`` or ``tag: 2`` in a values file is a number to YAML, a float to Helm: the
    image read radixgate:%!s(float64=2.0240101e+07)."""
    objects = render(chart, image={"tag": tag}, redis={"image": {"tag": tag}})
    assert container(one(objects, "Deployment", "router"))["image"] == f"radixgate:{tag}"
    assert container(one(objects, "StatefulSet", "worker"))["image"] == f"radixgate:{tag}"
    assert container(one(objects, "Deployment", "redis"))["image"] == f"redis:{tag}"


def test_a_new_admin_token_rolls_the_pods_that_read_it(chart) -> None:
    """The processes read the token from their environment at start: a changed Secret alone left the old
    token in effect until something else rolled them."""

    def checksums(**values: Any) -> list[str | None]:
        objects = render(chart, **values)
        return [one(objects, kind, component)["spec"]["template"]["metadata"].get("annotations", {})
                .get("checksum/secret") for kind, component in (("Deployment", "router"), ("StatefulSet", "worker"))]  # fmt: skip

    assert checksums() == [None, None]
    old, new = checksums(adminToken={"value": "old"}), checksums(adminToken={"value": "new"})
    assert old[0] == old[1] and new[0] == new[1] and old[0] != new[0] and None not in old


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"router": {"kvEvents": "redis"}, "redis": {"enabled": False}},
            "router.kvEvents: redis needs a Redis",
        ),
        (
            {"router": {"config": {"log_level": "debug", "kv_events": "http", "health_interval_s": 2}}},
            "use the values named instead: kv_events (router.kvEvents), log_level (router.logLevel)",
        ),
        ({"router": {"config": {"workers": ["http://w:8001"]}}}, "workers (worker.replicas)"),
        (
            {"router": {"config": {"admin_token": "x"}}, "adminToken": {"value": "t"}},
            "admin_token (adminToken)",
        ),
    ],
    ids=["redis-events-without-redis", "config-keys-the-flags-set", "config-workers", "config-admin-token"],
)
def test_settings_the_router_would_refuse_or_ignore_fail_to_render(chart, values: dict, message: str) -> None:
    """kvEvents redis without a Redis rendered, and the router then stopped at start; a router.config key
    the chart also passes as a flag or variable was ignored without a word (flags win)."""
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render(chart, **values)
    assert render(
        chart,
        router={"config": {"admin_token": "x", "redis_url": "redis://r:6379/0"}},
        redis={"enabled": False},
    )


def test_lora_adapters_reach_the_workers_as_their_variable(chart, monkeypatch) -> None:
    worker = container(one(render(chart), "StatefulSet", "worker"))
    assert "RADIXGATE_WORKER_LORA_ADAPTERS" not in {e["name"] for e in worker["env"]}
    objects = render(
        chart, worker={"loraAdapters": ["sql=/models/adapters/sql", "chat=/models/adapters/chat"]}
    )
    env = {e["name"]: e.get("value") for e in container(one(objects, "StatefulSet", "worker"))["env"]}
    value = env["RADIXGATE_WORKER_LORA_ADAPTERS"]
    monkeypatch.setenv("RADIXGATE_WORKER_LORA_ADAPTERS", value)
    assert parse_worker_args([]).lora_adapters == ["sql=/models/adapters/sql", "chat=/models/adapters/chat"]

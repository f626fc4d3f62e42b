"""deploy/k8s/ builds, validates and runs only commands pdserve accepts (no cluster needed).

Each overlay is rendered (tests/unit/kustomize_lite.py; where `kubectl` is installed, its
own `kubectl kustomize` must render the same objects), every object validates against the
Kubernetes schemas (kubernetes-validate, offline, strict: no unknown field), and every
container's command line, with the `$(VAR)`s Kubernetes fills in from its env resolved, is
parsed by the real parser of its `pdserve` command and turned into that command's config —
so a flag that does not exist, or a value the command refuses, fails here. Then what ties the
pieces together: the ports the flags open are the ports the pods declare and probe, nodes
register at a Service that reaches the router's gRPC port, the token file is the mounted
Secret, and the autoscalers read series the nodes export.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pdserve.node.config import parse_node_args
from pdserve.node.front.metrics import NodeStatsCollector
from pdserve.router.fronts.server import ROUTER_SERVICES, _parser as router_parser, config_from_args
from tests.unit import kustomize_lite
from tests.unit.kustomize_lite import containers

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
# The oldest Kubernetes the manifests are for: gRPC probes are GA from 1.27.
KUBERNETES_VERSION = "1.29"
POD_IP = "10.1.2.3"
NODE_KINDS = ("prefill", "decode", "colocated")
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> list[dict[str, Any]]:
    return kustomize_lite.build(K8S / "overlays" / request.param)


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in WORKLOADS]


def pdserve_containers(objects):
    """(workload, container) for every container that runs `pdserve`."""
    return [(o, c) for o in workloads(objects) for c in containers(o) if c.get("command") == ["pdserve"]]


def test_there_are_overlays_for_a_demo_and_for_autoscaling():
    assert {"demo", "autoscaling"} <= set(OVERLAYS)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: the renderer alone is used")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubectl_kustomize_renders_the_same_objects(overlay):
    out = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)], check=True,
                         capture_output=True, text=True).stdout
    theirs = [doc for doc in yaml.safe_load_all(out) if doc]
    ours = kustomize_lite.build(K8S / "overlays" / overlay)
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(theirs, key=key) == sorted(ours, key=key)


def test_every_object_validates_against_the_kubernetes_schemas(rendered):
    for obj in rendered:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def env_of(container: dict[str, Any], pod_name: str, objects: list[dict[str, Any]]) -> dict[str, str]:
    """The values Kubernetes gives the container's env (downward API, resources, ConfigMaps)."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[var["name"]] = {"status.podIP": POD_IP, "metadata.name": pod_name}[source["fieldRef"]["fieldPath"]]
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            quantity = container["resources"][ref["resource"].split(".")[0]][ref["resource"].split(".")[1]]
            env[var["name"]] = str(math.ceil(cpu_cores(quantity) / cpu_cores(ref.get("divisor", "1"))))
        else:
            ref = source["configMapKeyRef"]
            env[var["name"]] = kustomize_lite.find(objects, "ConfigMap", ref["name"])["data"][ref["key"]]
    return env


def cpu_cores(quantity: str | int) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def argv_of(workload, container, objects) -> list[str]:
    env = env_of(container, f"{workload['metadata']['name']}-7d9f-abcde", objects)

    def fill(match: re.Match) -> str:
        assert match.group(1) in env, f"{container['name']}: $({match.group(1)}) is not in its env"
        return env[match.group(1)]
    return [VAR.sub(fill, arg) for arg in container["args"]]


def flags_of(argv: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in argv if arg.startswith("--") and "=" in arg)


def test_every_pdserve_command_line_is_accepted_by_its_command(rendered, tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text("a-token\n")
    checked = set()
    for workload, container in pdserve_containers(rendered):
        command, *rest = argv_of(workload, container, rendered)
        # The token file is the mounted Secret's; here a real file stands in for it.
        rest = [f"--auth-token-file={token}" if a.startswith("--auth-token-file=") else a for a in rest]
        try:
            if command == "router":
                config_from_args(router_parser().parse_args(rest), {})
            else:
                assert command in NODE_KINDS, f"{container['name']}: pdserve {command} is not a server command"
                parse_node_args(rest, command, {})
        except SystemExit:
            pytest.fail(f"{workload['metadata']['name']}: pdserve {command} refused its args: "
                        f"{capsys.readouterr().err}")
        checked.add(command)
    assert checked == {"router", "prefill", "decode"}


def test_other_containers_only_build_the_demo_model_as_compose_does(rendered):
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for workload in workloads(rendered):
        for container in containers(workload):
            if container.get("command") != ["pdserve"]:
                assert container["command"] == compose["services"]["model"]["command"], container["name"]
                assert {"name": "PDSERVE_CACHE", "value": "/models"} in container["env"]


def test_every_container_runs_the_dockerfiles_image_as_its_user(rendered):
    dockerfile = (ROOT / "Dockerfile").read_text()
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert "--uid 10001" in dockerfile
    for workload in workloads(rendered):
        assert workload["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001
        for container in containers(workload):
            assert container["image"] == compose["x-pdserve"]["image"]


def test_ports_flags_declarations_and_probes_agree(rendered):
    for workload, container in pdserve_containers(rendered):
        flags = flags_of(argv_of(workload, container, rendered))
        opened = {int(flags[f]) for f in ("port", "http-port", "metrics-port", "kv-port") if f in flags}
        declared = {p["containerPort"] for p in container["ports"]}
        assert opened == declared, workload["metadata"]["name"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in container:
                assert container[probe]["grpc"]["port"] == int(flags["port"]), (workload["metadata"]["name"], probe)
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == flags["metrics-port"]


def test_the_router_is_ready_with_a_route_and_alive_while_it_runs(rendered):
    (router,) = [c for _, c in pdserve_containers(rendered) if c["args"][0] == "router"]
    assert "service" not in router["readinessProbe"]["grpc"]  # overall: SERVING only with a route
    assert router["livenessProbe"]["grpc"]["service"] in ROUTER_SERVICES


def test_nodes_register_at_a_service_that_reaches_the_router_before_it_is_ready(rendered):
    services = {o["metadata"]["name"]: o for o in rendered if o["kind"] == "Service"}
    (router_workload, router) = [(w, c) for w, c in pdserve_containers(rendered) if c["args"][0] == "router"][0]
    router_port = int(flags_of(argv_of(router_workload, router, rendered))["port"])
    router_labels = router_workload["spec"]["template"]["metadata"]["labels"]
    for workload, container in pdserve_containers(rendered):
        flags = flags_of(argv_of(workload, container, rendered))
        if container["args"][0] == "router":
            continue
        assert flags["host"] == flags["kv-host"] == POD_IP  # each replica binds and registers its own IP
        name, port = flags["router"].rsplit(":", 1)
        service = services[name]
        assert service["spec"]["selector"].items() <= router_labels.items()
        assert service["spec"]["publishNotReadyAddresses"] is True  # the router is ready only once nodes join
        (target,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
        named = {p["name"]: p["containerPort"] for p in router["ports"]}
        assert named.get(target["targetPort"], target["targetPort"]) == router_port


def test_the_auth_token_file_is_the_mounted_secret(rendered):
    for workload, container in pdserve_containers(rendered):
        path = Path(flags_of(container["args"])["auth-token-file"])
        (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == path.parent]
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes[mount["name"]]["secret"]["secretName"] == "pdserve-auth"


def test_the_model_is_on_the_models_volume(rendered):
    model = kustomize_lite.find(rendered, "ConfigMap", "pdserve-model")["data"]["path"]
    for workload, container in pdserve_containers(rendered):
        assert flags_of(argv_of(workload, container, rendered))["model"] == model
        (mount,) = [m for m in container["volumeMounts"] if model.startswith(m["mountPath"] + "/")]
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == "pdserve-models"
    assert kustomize_lite.find(rendered, "PersistentVolumeClaim", "pdserve-models")


def test_each_pool_has_a_disruption_budget_and_a_termination_grace(rendered):
    budgets = [o for o in rendered if o["kind"] == "PodDisruptionBudget"]
    for workload, container in pdserve_containers(rendered):
        if container["args"][0] == "router":
            continue
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 30


def test_autoscalers_scale_each_pool_on_series_its_nodes_export():
    objects = kustomize_lite.build(K8S / "overlays" / "autoscaling")
    exported = {metric.name for metric in NodeStatsCollector(lambda: None).describe()}
    scaled = {}
    for hpa in (o for o in objects if o["kind"] == "HorizontalPodAutoscaler"):
        target = kustomize_lite.find(objects, hpa["spec"]["scaleTargetRef"]["kind"], hpa["spec"]["scaleTargetRef"]["name"])
        assert "replicas" not in target["spec"]  # the HPA owns it: applying again never resets it
        scaled[target["metadata"]["name"]] = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert scaled == {
        "pdserve-prefill": {"pdserve_queued_prefill_tokens"},
        "pdserve-decode": {"pdserve_kv_cache_usage_ratio", "pdserve_num_requests_running"},
    }
    assert set().union(*scaled.values()) <= exported

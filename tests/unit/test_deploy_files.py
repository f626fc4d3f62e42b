"""compose.yaml, Dockerfile and .dockerignore say what the README promises.

Static checks (no Docker needed): the services exist, only the router publishes a port
(on the host's 127.0.0.1), the node pools scale (no fixed names, no host ports, each
replica registers its own address), nodes reach the router by service name, every
long-running service has a healthcheck, the auth token comes from the host's
environment only (empty by default: no authentication), and the image installs
torch==2.13.0 first, then the project.
"""

from __future__ import annotations

import argparse

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from pdserve.cluster import ClusterConfig, build_plan
from pdserve.common.paths import DEMO_MODEL_NAME
from pdserve.node.config import add_node_args

ROOT = Path(__file__).resolve().parents[2]
NODES = ("prefill", "decode")
MODEL_DIR = "/models/demo-llama-small"


def _node_flags() -> set[str]:
    parser = argparse.ArgumentParser()
    add_node_args(parser)
    return {flag for action in parser._actions for flag in action.option_strings}


# The node CLI contract (pdserve prefill|decode ...): what the node's parser takes.
NODE_FLAGS = _node_flags()
# The one value compose fills in from the host's environment (a lone `$`).
HOST_TOKEN = "${PDSERVE_AUTH_TOKEN:-}"


def _strings(obj: object):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _strings(key)
            yield from _strings(value)
    elif isinstance(obj, list):
        for item in obj:
            yield from _strings(item)


def _as_compose_passes_it(obj: object) -> object:
    """Compose turns `$$` into a literal `$` for the container (a lone `$` is host interpolation)."""
    if isinstance(obj, str):
        return obj.replace("$$", "$")
    if isinstance(obj, dict):
        return {key: _as_compose_passes_it(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_as_compose_passes_it(item) for item in obj]
    return obj


@pytest.fixture(scope="module")
def raw_compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def compose(raw_compose) -> dict:
    return _as_compose_passes_it(raw_compose)


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def _argv(service: dict) -> list[str]:
    """The pdserve command line a service runs (inside `sh -c '... exec pdserve ...'` too)."""
    command = service["command"]
    if isinstance(command, list) and command[:2] == ["sh", "-c"]:
        command = command[2].split("exec ", 1)[1]
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    return argv


def _flags(argv: list[str]) -> dict[str, str]:
    return {flag: value for flag, value in zip(argv, argv[1:]) if flag.startswith("--")}


def test_services_present(services):
    assert set(services) == {"model", "router", "prefill", "decode"}


def test_only_the_router_publishes_a_port_on_localhost(services):
    assert services["router"]["ports"] == ["127.0.0.1:50051:50051", "127.0.0.1:8000:8000"]
    assert [name for name, s in services.items() if "ports" in s] == ["router"]
    assert _flags(_argv(services["router"]))["--port"] == "50051"
    assert _flags(_argv(services["router"]))["--http-port"] == "8000"  # the OpenAI-compatible API


@pytest.mark.parametrize("name", NODES)
def test_nodes_scale(services, name):
    node = services[name]
    for fixed in ("container_name", "hostname", "ports"):
        assert fixed not in node, f"{name}.{fixed} would break --scale {name}=N"
    argv = _argv(node)
    assert argv[:2] == ["pdserve", name]
    flags = _flags(argv)
    # Each replica binds and registers its own container address, found at start.
    assert flags["--host"] == flags["--kv-host"] == "$ip"
    assert 'ip=$(getent ahostsv4 "$HOSTNAME"' in node["command"][2]
    assert "$HOSTNAME" in flags["--node-id"]  # unique per replica
    assert sorted(node["expose"]) == sorted([flags["--port"], flags["--kv-port"]])


@pytest.mark.parametrize("name", NODES)
def test_nodes_find_the_router_by_service_name(services, name):
    flags = _flags(_argv(services[name]))
    assert flags["--router"] == "router:50051"
    assert set(flags) <= NODE_FLAGS, f"flags outside the node CLI contract: {set(flags) - NODE_FLAGS}"
    assert services[name]["depends_on"]["router"]["condition"] == "service_started"


def test_healthchecks_on_router_and_nodes(services):
    router_test = services["router"]["healthcheck"]["test"]
    assert router_test[:4] == ["CMD", "python", "-m", "pdserve.healthcheck"]
    assert router_test[-1] == "127.0.0.1:50051" and "router" in router_test
    for name in NODES:
        kind, test = services[name]["healthcheck"]["test"]
        assert kind == "CMD-SHELL"
        port = _flags(_argv(services[name]))["--port"]
        assert test == f'python -m pdserve.healthcheck --service {name} "$HOSTNAME:{port}"'


def test_model_volume_is_built_once_and_shared(compose, services):
    assert "models" in compose["volumes"]
    for name, service in services.items():
        assert "models:/models" in service["volumes"], name
        assert service["environment"]["PDSERVE_CACHE"] == "/models", name
    assert "ensure_demo_model()" in services["model"]["command"][-1]
    for name in ("router", *NODES):
        assert _flags(_argv(services[name]))["--model"] == MODEL_DIR
        assert services[name]["depends_on"]["model"]["condition"] == "service_completed_successfully"
    # The directory ensure_demo_model() makes under $PDSERVE_CACHE.
    assert Path(MODEL_DIR).name == DEMO_MODEL_NAME


def test_compose_dollars_are_escaped(raw_compose):
    # A lone `$` would be filled in by compose from the HOST's environment (e.g. the
    # host's $HOSTNAME); `$$` reaches the container's shell as `$`.
    lone = [text for text in _strings(raw_compose) if "$" in text.replace("$$", "").replace(HOST_TOKEN, "")]
    assert not lone


def test_the_auth_token_comes_from_the_host_and_defaults_to_none(services):
    for name, service in services.items():
        assert service["environment"]["PDSERVE_AUTH_TOKEN"] == HOST_TOKEN, name
        # Only the environment: a --auth-token-file in a command would need that file in every container.
        assert not any("--auth-token-file" in text for text in _strings(service["command"])), name
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "PDSERVE_AUTH_TOKEN" not in dockerfile  # no secret in an image layer


def test_nothing_but_the_router_listens_on_all_interfaces(services):
    # Inside its container the router must take the published port's traffic; the nodes
    # bind their own container address.
    assert _flags(_argv(services["router"]))["--host"] == "0.0.0.0"
    for name in NODES:
        flags = _flags(_argv(services[name]))
        assert "0.0.0.0" not in (flags["--host"], flags["--kv-host"]), name


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def test_dockerfile_installs_torch_first_then_the_project():
    steps = _dockerfile_instructions()
    assert steps[0] == ("FROM", "python:3.11-slim")

    def step(match) -> int:
        return next(i for i, (op, arg) in enumerate(steps) if match(op, arg))

    torch_step = step(lambda op, arg: op == "RUN" and "pip install" in arg and "torch==2.13.0" in arg)
    copy_step = step(lambda op, arg: (op, arg) == ("COPY", ". ."))
    project_step = step(lambda op, arg: op == "RUN" and re.search(r"pip install \.(\s|$)", arg))
    # torch before the sources: a code change does not reinstall torch (layer cache).
    assert torch_step < copy_step < project_step
    assert "download.pytorch.org/whl/cpu" in dict(steps)["ARG"]  # CPU wheels only


def test_dockerignore_keeps_what_pip_install_needs():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert ".git" in ignored
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", project["project"]["readme"], "pdserve"}
    assert not needed & ignored


def test_the_local_cluster_uses_only_contract_flags():
    plan = build_plan(ClusterConfig(), "/m", 50051, python="py")
    for node in plan.nodes:
        assert set(_flags(list(node.argv))) <= NODE_FLAGS

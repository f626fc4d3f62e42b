"""The product's parts import only downwards, and every part is installed.

Read from the source (ast), not by importing: a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Each part (a top-level folder, installed as pdserve.<folder>) and the parts it may import.
# `pdserve` (CLI, LLM, launcher) and `bench` sit on top and may import any part.
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "proto": {"engine"},  # proto/convert.py: proto <-> engine values; the engine never imports proto
    "kernels": {"common"},
    "engine": {"kernels", "common"},
    "kv_transfer": {"common"},
    "node": {"engine", "kernels", "kv_transfer", "proto", "common"},
    "prefill_node": {"node", "engine", "kernels", "kv_transfer", "proto", "common"},
    "decode_node": {"node", "engine", "kernels", "kv_transfer", "proto", "common"},
    "router": {"engine", "proto", "common"},
}
# Third-party modules a part must never load: the engine and its kernels run in a node's core
# process, which talks ZMQ only through node/, and never serves gRPC.
FORBIDDEN_EXTERNAL: dict[str, set[str]] = {
    "engine": {"grpc", "zmq", "ucxx"},
    "kernels": {"grpc", "zmq", "ucxx"},
    "common": {"zmq", "ucxx", "torch"},
}


def imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


def part_of(module: str) -> str | None:
    """The part a pdserve module belongs to (`pdserve.engine.x` -> engine, `pdserve.cli` -> pdserve)."""
    parts = module.split(".")
    if parts[0] != "pdserve":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED | {"bench": set()} else "pdserve"


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_part_imports_only_the_parts_below_it(part):
    offenders = []
    for path in sorted((ROOT / part).rglob("*.py")):
        for module in imported_modules(path):
            target = part_of(module)
            if target is not None and target != part and target not in ALLOWED[part]:
                offenders.append(f"{path.relative_to(ROOT)} imports {module}")
            if module.split(".")[0] in FORBIDDEN_EXTERNAL.get(part, set()):
                offenders.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not offenders, "\n".join(offenders)


def test_every_part_folder_is_an_installed_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dirs = config["package-dir"]
    folders = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    for folder in folders:
        name = "pdserve" if folder == "pdserve" else f"pdserve.{folder}"
        assert name in config["packages"], f"{folder}/ is not in pyproject's packages"
        assert package_dirs.get(name) == folder, f"{name} is not mapped to {folder}/ in pyproject's package-dir"
    subpackages = {p.parent for p in ROOT.glob("*/*/__init__.py") if p.parts[-3] != "tests"}
    for sub in subpackages:
        name = f"pdserve.{sub.parent.name}.{sub.name}" if sub.parent.name != "pdserve" else f"pdserve.{sub.name}"
        assert name in config["packages"], f"{sub.relative_to(ROOT)}/ is not in pyproject's packages"


# The router's groups (router/__init__.py), bottom up: each imports only the groups below it.
ROUTER_FLOORS = ("", "cluster", "requests", "dispatch", "fronts")  # "": router/ itself


def router_group(module: str) -> str | None:
    """`pdserve.router.cluster.registry` -> cluster; `pdserve.router.errors` -> ""; else None."""
    parts = module.split(".")
    if parts[:2] != ["pdserve", "router"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in ROUTER_FLOORS else ""


@pytest.mark.parametrize("group", ROUTER_FLOORS)
def test_router_groups_import_only_the_floors_below(group):
    allowed = set(ROUTER_FLOORS[: ROUTER_FLOORS.index(group) + 1])
    folder = ROOT / "router" / group
    files = folder.rglob("*.py") if group else folder.glob("*.py")
    offenders = [f"{path.relative_to(ROOT)} imports {module}"
                 for path in sorted(files) for module in imported_modules(path)
                 if router_group(module) is not None and router_group(module) not in allowed]
    assert not offenders, "\n".join(offenders)


# node/'s parts (node/__init__.py), bottom up: each imports only the parts below it.
NODE_FLOORS = ("", "ranks", "core", "front")  # "": node/ itself


def node_part(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["pdserve", "node"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in NODE_FLOORS else ""


@pytest.mark.parametrize("part", NODE_FLOORS)
def test_node_parts_import_only_the_floors_below(part):
    allowed = set(NODE_FLOORS[: NODE_FLOORS.index(part) + 1])
    folder = ROOT / "node" / part
    files = folder.rglob("*.py") if part else folder.glob("*.py")
    offenders = [f"{path.relative_to(ROOT)} imports {module}"
                 for path in sorted(files) for module in imported_modules(path)
                 if node_part(module) is not None and node_part(module) not in allowed]
    assert not offenders, "\n".join(offenders)

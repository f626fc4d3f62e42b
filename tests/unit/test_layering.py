"""The product's parts import only downwards, and every part is installed.

Read from the source (ast), not by importing: a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pdserve"
# Each part (a folder of pdserve/, imported as pdserve.<folder>) and the parts it may import.
# `pdserve` (CLI, LLM, launcher) and `bench` sit on top and may import any part.
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "proto": {"engine"},  # pdserve/proto/convert.py: proto <-> engine values; the engine never imports proto
    "kernels": {"common"},
    "engine": {"kernels", "common"},
    "kv_transfer": {"common"},
    # A node's tensor-parallel ranks: an engine on T processes, which the offline `LLM` starts as
    # a node's core does, so they sit below pdserve/node/ (never reaching the front's gRPC or ZMQ).
    "ranks": {"engine", "kernels", "kv_transfer", "common"},
    "node": {"ranks", "engine", "kernels", "kv_transfer", "proto", "common"},
    "prefill_node": {"node", "ranks", "engine", "kernels", "kv_transfer", "proto", "common"},
    "decode_node": {"node", "ranks", "engine", "kernels", "kv_transfer", "proto", "common"},
    "router": {"engine", "proto", "common"},
    # The test harness: it runs the real router server (router), serves the node services and
    # registers like a node (proto, and kv_transfer for the KV layout version a fingerprint
    # states), and reads /metrics as everything else does (common). Only tests and bench import
    # it; the model fixtures stay in tests/ (model_factory belongs to the top part).
    "testing": {"router", "proto", "kv_transfer", "common"},
    # On top beside bench and pdserve: the simulator reuses bench's workloads, metrics and goodput
    # search, the router's placement policies and the prefill node's policy, its commands the demo
    # model (pdserve.model_factory); only the CLI imports it (by name, when the command runs). A TP
    # profile times an engine on its ranks, started as a node starts them (ranks).
    "planner": {"engine", "kernels", "common", "ranks", "router", "prefill_node", "bench", "pdserve"},
}
# Third-party modules a part must never load: the engine and its kernels run in a node's core
# process, which talks ZMQ only through pdserve/node/, and never serves gRPC.
FORBIDDEN_EXTERNAL: dict[str, set[str]] = {
    "engine": {"grpc", "zmq", "ucxx"},
    "kernels": {"grpc", "zmq", "ucxx"},
    "common": {"zmq", "ucxx", "torch"},
    "planner": {"grpc", "zmq", "ucxx"},
    "ranks": {"grpc", "zmq"},
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
    for path in sorted((PACKAGE / part).rglob("*.py")):
        for module in imported_modules(path):
            target = part_of(module)
            if target is not None and target != part and target not in ALLOWED[part]:
                offenders.append(f"{path.relative_to(ROOT)} imports {module}")
            if module.split(".")[0] in FORBIDDEN_EXTERNAL.get(part, set()):
                offenders.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not offenders, "\n".join(offenders)


def test_every_part_folder_is_an_installed_package():
    """pyproject finds the packages under pdserve/ by their __init__.py: a folder of modules
    without one would be left out of the installed distribution."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert find["include"] == ["pdserve*"]
    folders = {p.parent for p in PACKAGE.rglob("*.py")} - {PACKAGE}
    missing = [f"{f.relative_to(ROOT)}/" for f in sorted(folders) if "__pycache__" not in f.parts
               and not (f / "__init__.py").exists()]
    assert not missing, f"no __init__.py, so not installed: {missing}"


def test_no_folder_at_the_root_is_importable():
    """The checkout's root is on sys.path under `python -m` (and pytest): a package folder there
    would shadow a third-party package of the same name (`kernels` did, for transformers)."""
    importable = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    assert importable == ["pdserve", "tests"]


# Parts with groups on import floors of their own (pdserve/router/__init__.py, pdserve/node/__init__.py), bottom
# up: each group imports only the groups below it; "" is the part's own top-level modules.
FLOORS = {"router": ("", "cluster", "requests", "dispatch", "fronts"), "node": ("", "core", "front")}


def group_of(module: str, part: str) -> str | None:
    """`pdserve.router.cluster.registry` -> cluster; `pdserve.router.errors` -> ""; another part: None."""
    parts = module.split(".")
    if parts[:2] != ["pdserve", part] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in FLOORS[part] else ""


@pytest.mark.parametrize("part, group", [(part, group) for part, floors in FLOORS.items() for group in floors])
def test_groups_import_only_the_floors_below(part, group):
    floors = FLOORS[part]
    allowed = set(floors[: floors.index(group) + 1])
    folder = PACKAGE / part / group
    files = folder.rglob("*.py") if group else folder.glob("*.py")
    offenders = [f"{path.relative_to(ROOT)} imports {module}"
                 for path in sorted(files) for module in imported_modules(path)
                 if group_of(module, part) is not None and group_of(module, part) not in allowed]
    assert not offenders, "\n".join(offenders)

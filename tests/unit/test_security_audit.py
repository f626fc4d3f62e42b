"""Source-level guarantees: nothing deserializes network data with pickle or eval, and every
listener binds 127.0.0.1 unless told otherwise.

The first test walks the syntax tree of every module the distribution installs (prose
that says "never pickle" does not count): no import of a pickle-family module, no call
of eval/exec, no torch.load / yaml.load / numpy.load(allow_pickle=True). The node IPC
is JSON, the KV wire fixed-layout bytes plus JSON, gRPC protobuf; a new deserializer
must be one of those too.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.cluster import ClusterConfig
from pdserve.kv_transfer import KVTransferConfig
from pdserve.node.config import NodeConfig, add_node_args
from pdserve.router.config import RouterConfig
from pdserve.router.fronts.server import _parser as router_parser

ROOT = Path(__file__).resolve().parents[2]
PICKLE_FAMILY = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "jsonpickle"}
UNSAFE_LOADS = {("torch", "load"), ("yaml", "load"), ("yaml", "unsafe_load"), ("yaml", "full_load")}
LOOPBACK = "127.0.0.1"


def _modules() -> list[Path]:
    return sorted((ROOT / "pdserve").rglob("*.py"))


def _findings(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] in PICKLE_FAMILY]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_FAMILY:
            found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("eval", "exec"):
                found.append((node.lineno, f"{func.id}(...)"))
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                if (func.value.id, func.attr) in UNSAFE_LOADS:
                    found.append((node.lineno, f"{func.value.id}.{func.attr}(...)"))
                allows_pickle = any(k.arg == "allow_pickle" for k in node.keywords)
                if func.value.id in ("np", "numpy") and func.attr == "load" and allows_pickle:
                    found.append((node.lineno, "numpy.load(allow_pickle=...)"))
    return found


def test_the_audit_sees_the_whole_installed_tree():
    modules = {path.relative_to(ROOT).as_posix() for path in _modules()}
    for expected in ("pdserve/node/messages.py", "pdserve/kv_transfer/wire.py", "pdserve/kv_transfer/ucx.py", "pdserve/router/fronts/server.py",
                     "pdserve/common/auth.py", "pdserve/node/core/kv_done.py"):
        assert expected in modules


def test_the_audit_catches_what_it_looks_for():
    source = ("import pickle\nfrom marshal import loads\nx = eval('1')\ntorch.load(f)\nmodel.eval()\n"
              "np.load(f, allow_pickle=True)\n")
    assert [what for _, what in _findings(ast.parse(source))] == [
        "import pickle", "from marshal import ...", "eval(...)", "torch.load(...)", "numpy.load(allow_pickle=...)"]


def test_no_module_unpickles_or_evaluates_anything():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {what}"
                 for path in _modules() for line, what in _findings(ast.parse(path.read_text(), str(path)))]
    assert offenders == []


@pytest.mark.parametrize(
    "name, host",
    [
        ("router", RouterConfig(model="m").host),
        ("node gRPC", NodeConfig(EngineConfig("m")).host),
        ("node KV transfer", NodeConfig(EngineConfig("m")).transfer.host),
        ("KV transport", KVTransferConfig().host),
        ("local cluster", ClusterConfig().host),
        ("router --host", router_parser().parse_args(["--model", "m"]).host),
    ],
)
def test_every_listener_defaults_to_loopback(name, host):
    assert host == LOOPBACK, name


def test_node_flags_default_to_loopback_and_no_auth():
    parser = argparse.ArgumentParser()
    add_node_args(parser)
    args = parser.parse_args(["--model", "m"])
    assert (args.host, args.kv_host, args.auth_token_file) == (LOOPBACK, LOOPBACK, None)
    assert RouterConfig(model="m").auth_token is None and NodeConfig(EngineConfig("m")).auth_token is None


def test_tokens_stay_out_of_reprs():
    secret = "do-not-log-me"
    for value in (RouterConfig(model="m", auth_token=secret), NodeConfig(EngineConfig("m"), auth_token=secret),
                  KVTransferConfig(auth_token=secret)):
        assert secret not in repr(value)

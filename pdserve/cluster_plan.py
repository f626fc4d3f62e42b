"""What `pdserve cluster` starts: every child's command line, cores, ports and addresses.

Owns the plan (`build_plan`): the router's and each node's argv (`python -m pdserve <kind>
...`, each pool tuned by its own pass-through flags), a concrete gRPC port for every node
(picked free here, so the node keeps its address across restarts and programs can reach
it), the metrics ports when asked, the cores of each child when pools are pinned (each
pool's cores split evenly across its nodes, passed as `--cpus`), and each node's torch
threads. Must never start a process.
"""

from __future__ import annotations

import os
import random
import socket
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from pdserve.cluster_config import THREADS_FLAGS, ClusterConfig, ClusterError
from pdserve.cluster_supervisor import ChildSpec
from pdserve.common.port_picks import PortLedger
from pdserve.common.affinity import available_cpus, check_available, format_cpu_list, split_cpus
from pdserve.common.tls import TlsConfig, http_scheme

@dataclass(frozen=True)
class ClusterPlan:
    """What to start: the router, then the nodes; and the router address to probe."""

    router: ChildSpec
    nodes: tuple[ChildSpec, ...]
    router_addr: str
    addresses: dict[str, str] = field(default_factory=dict)  # node name -> its gRPC HOST:PORT
    metrics_ports: dict[str, int] = field(default_factory=dict)  # child name -> /metrics port, when asked
    http_port: int | None = None  # the router's OpenAI-compatible API
    model_dir: str = ""
    tls: TlsConfig | None = None  # every child's (pdserve/common/tls.py); None: plaintext

    def http_url(self, host: str) -> str | None:
        return f"{http_scheme(self.tls)}://{host}:{self.http_port}/v1" if self.http_port is not None else None

    def metrics_urls(self, host: str) -> dict[str, str]:
        return {name: f"http://{host}:{port}/metrics" for name, port in self.metrics_ports.items()}

    def with_node_replaced(self, leaving: str, joined: ChildSpec, host: str, metrics_port: int | None) -> ClusterPlan:
        """This plan with node `leaving` gone and `joined` started (the load mode's move)."""
        addresses = {n: a for n, a in self.addresses.items() if n != leaving}
        metrics = {n: p for n, p in self.metrics_ports.items() if n != leaving}
        if metrics_port is not None:
            metrics[joined.name] = metrics_port
        return replace(self, nodes=tuple(s for s in self.nodes if s.name != leaving) + (joined,),
                       addresses={**addresses, joined.name: f"{host}:{spec_port(joined)}"}, metrics_ports=metrics)


def build_plan(config: ClusterConfig, model_dir: str, router_port: int, python: str = sys.executable,
               usable_cpus: Collection[int] | None = None, pick_port: Callable[[], int] | None = None) -> ClusterPlan:
    """The command line (and cores) of every child of the cluster.

    `usable_cpus`: the cores pinned children may use (None: this process's own affinity).
    `pick_port`: a free port for a node or a metrics endpoint (None: ask the OS on the host).
    Raises ValueError naming the flag when a pool's cores are not on this machine.
    """
    check_cores(config, usable_cpus)
    pick_port = pick_port or (lambda: resolve_port(config.host, 0))
    base = (python, "-m", "pdserve")
    router_addr = f"{config.host}:{router_port}"
    metrics_ports = _metrics_ports(config, pick_port)
    http_port = None if config.http_port is None else config.http_port or pick_port()
    http = ("--http-port", str(http_port)) if http_port is not None else ()
    drain = ("--drain-timeout-s", f"{config.drain_timeout_s:g}")
    router = ChildSpec("router", (*base, "router", "--host", config.host, "--port", str(router_port),
                                  "--model", model_dir, "--block-size", str(config.block_size), *http,
                                  *_auth_args(config), *_api_keys_args(config), *_tls_args(config),
                                  *_metrics_args(metrics_ports, "router"),
                                  *drain,
                                  *config.router_args),
                       cpus=config.router_cores)
    nodes, addresses = [], {}
    for pool in config.pools:
        cores = split_cpus(pool.cores, pool.count, pool.cores_flag) if pool.cores else [None] * pool.count
        for index, cpus in enumerate(cores):
            name = f"{pool.kind}-{index}"
            spec = node_spec(config, NodeSite(model_dir, router_addr, python), pool.kind, name, cpus, pick_port(),
                             metrics_ports.get(name))
            nodes.append(spec)
            addresses[name] = f"{config.host}:{spec_port(spec)}"
    return ClusterPlan(router, tuple(nodes), router_addr, addresses, metrics_ports, http_port, model_dir, config.tls)


@dataclass(frozen=True)
class NodeSite:
    """What every node of one cluster is started with: the model, the router, the interpreter."""

    model_dir: str
    router_addr: str
    python: str = sys.executable


def node_spec(config: ClusterConfig, site: NodeSite, kind: str, name: str, cpus: tuple[int, ...] | None,
              port: int, metrics_port: int | None) -> ChildSpec:
    """One node's command line: `kind`'s pool flags, on `port`, pinned to `cpus` (None: not pinned).
    Also how the launcher's load mode starts a node moved into another pool."""
    pool = next(p for p in config.pools if p.kind == kind)
    # A colocated node moves no KV between nodes: it has no transfer listener to place.
    kv = ("--kv-host", config.host, "--kv-port", "0") if kind != "colocated" else ()
    pin = ("--cpus", format_cpu_list(cpus)) if cpus else ()
    metrics = ("--metrics-port", str(metrics_port)) if metrics_port is not None else ()
    drain = ("--drain-timeout-s", f"{config.drain_timeout_s:g}")
    argv = (site.python, "-m", "pdserve", kind, "--model", site.model_dir, "--host", config.host, "--port", str(port),
            "--router", site.router_addr, "--node-id", name, *kv, "--dtype", config.dtype,
            "--block-size", str(config.block_size), *_auth_args(config), *_tls_args(config), *pin, *metrics, *drain,
            *_threads_args(config, pool.args, pinned=cpus is not None), *pool.args)
    return ChildSpec(name, argv, cpus=cpus)


def spec_port(spec: ChildSpec) -> int:
    """The gRPC port on a node's command line."""
    return int(spec.argv[spec.argv.index("--port") + 1])


def _metrics_ports(config: ClusterConfig, pick_port: Callable[[], int]) -> dict[str, int]:
    if config.metrics_port is None:
        return {}
    names = [f"{pool.kind}-{i}" for pool in config.pools for i in range(pool.count)]
    return {"router": config.metrics_port or pick_port(), **{name: pick_port() for name in names}}


def _metrics_args(metrics_ports: dict[str, int], name: str) -> tuple[str, ...]:
    return ("--metrics-port", str(metrics_ports[name])) if name in metrics_ports else ()


def check_cores(config: ClusterConfig, usable_cpus: Collection[int] | None) -> None:
    flags = [(pool.cores_flag, pool.cores) for pool in config.pools] + [("--router-cores", config.router_cores)]
    pinned = [(flag, cores) for flag, cores in flags if cores is not None]
    if not pinned:
        return
    usable = available_cpus() if usable_cpus is None else usable_cpus
    for flag, cores in pinned:
        check_available(cores, flag, usable)


def _auth_args(config: ClusterConfig) -> tuple[str, ...]:
    return ("--auth-token-file", config.auth_token_file) if config.auth_token_file else ()


def _tls_args(config: ClusterConfig) -> tuple[str, ...]:
    return config.tls.flags() if config.tls is not None else ()


def _api_keys_args(config: ClusterConfig) -> tuple[str, ...]:
    return ("--api-keys-file", config.api_keys_file) if config.api_keys_file else ()


def _threads_args(config: ClusterConfig, extra: Sequence[str], pinned: bool) -> tuple[str, ...]:
    # Nodes on one machine share its cores; torch's default (all cores each) oversubscribes.
    # A pinned node runs one thread per core of its own unless told otherwise.
    if any(arg.split("=", 1)[0] in THREADS_FLAGS for arg in extra):
        return ()
    if pinned and config.threads_per_node is None:
        return ()
    threads = config.threads_per_node or max(1, (os.cpu_count() or 1) // config.num_nodes)
    return ("--num-threads", str(threads))


# Where a port the launcher picks for a child comes from: below the kernel's ephemeral range. The
# ports the OS hands out itself (a connection's source port, a listener bound to port 0: UCX's,
# another program's) come from that range, so a port picked there and bound moments later by the
# child may be taken meanwhile; below it only another launcher's pick competes.
PICK_LOW = 20000
PICK_TRIES = 64
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def resolve_port(host: str, port: int, rng: random.Random | None = None, ledger: PortLedger | None = None) -> int:
    """`port`, checked free on `host`; 0 → a free port below the ephemeral range, held in the
    machine's ledger of picks (pdserve/common/port_picks.py) so no other pick hands it out before the
    child binds it (the OS's own pick when none is found there)."""
    if port == 0:
        rng = rng or random.Random()
        high = _ephemeral_low() - 1
        tries = PICK_TRIES if high > PICK_LOW else 0
        picked = (ledger or PortLedger()).claim((rng.randint(PICK_LOW, high) for _ in range(tries)),
                                                lambda candidate: _is_free(host, candidate))
        if picked is not None:
            return picked
    try:
        return _bind(host, port)
    except OSError as err:
        raise ClusterError(f"cannot use {host}:{port} for the router ({err.strerror}); "
                           "pass --port 0 to pick a free port") from err


def _is_free(host: str, port: int) -> bool:
    try:
        _bind(host, port)
    except OSError:
        return False
    return True


def _bind(host: str, port: int) -> int:
    """The port, bound and let go at once; raises OSError when it cannot be bound."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        # SO_REUSEADDR so a TIME_WAIT leftover does not count as busy; a live listener still
        # does (the same probe as pdserve/common/ports.py's check_free, which also picks no port).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default

"""The launcher's config: `ClusterConfig`, its pools, and the `pdserve cluster` command line.

Owns every knob of the launcher with its default in one place, the flags the launcher
sets on its children itself (pass-through args must not), and the parsing of the command
line into a `ClusterConfig` (a frozen value, checked at construction: a bad value raises
ValueError naming the flag). Must never start a process or open a socket.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.cluster_load_mode import LoadModeSettings
from pdserve.cluster_supervisor import RestartPolicy
from pdserve.common.auth import add_auth_args
from pdserve.common.config_flags import add_config_args, values_from_args
from pdserve.common.lifecycle import DEFAULT_DRAIN_TIMEOUT_S
from pdserve.common.tls import FLAGS as TLS_FLAG_NAMES, TlsConfig, add_tls_args, tls_from_args
from pdserve.engine.config import AUTO_DTYPE, DEFAULT_BLOCK_SIZE, EngineConfig
from pdserve.common.affinity import cpu_list_arg, split_cpus

TLS_FLAGS = tuple(TLS_FLAG_NAMES.values())
# Flags the launcher sets itself on every node / on the router; pass-through args must not.
NODE_OWNED_FLAGS = ("--model", "--host", "--port", "--router", "--node-id", "--kv-host", "--kv-port",
                    "--dtype", "--block-size", "--auth-token-file", "--cpus", "--metrics-port", *TLS_FLAGS)
ROUTER_OWNED_FLAGS = ("--host", "--port", "--model", "--prefill", "--decode", "--block-size", "--auth-token-file",
                      "--metrics-port", "--http-port", "--api-keys-file", *TLS_FLAGS)
DEFAULT_HTTP_PORT = 8000
THREADS_FLAGS = ("--num-threads", "--threads")


class ClusterError(RuntimeError):
    """The cluster could not be started or kept up."""


@dataclass(frozen=True)
class ClusterConfig:
    """Every knob of the launcher, with its default in one place."""

    model: str | None = None  # None: the built-in demo model (built once, cached)
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0  # > 0: a colocated cluster, with no prefill or decode pool
    host: str = "127.0.0.1"
    port: int = 50051  # router port; 0 picks a free one
    # Cluster-wide engine facts, handed to every node: both pools' KV layouts must match.
    dtype: str = AUTO_DTYPE  # each node resolves it for its machine (engine/dtype_choice)
    block_size: int = DEFAULT_BLOCK_SIZE
    threads_per_node: int | None = None  # None: the machine's cores split over the nodes
    router_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    colocated_args: tuple[str, ...] = ()
    # Cores as devices: a pool's cores, split evenly across its nodes; None: not pinned.
    prefill_cores: tuple[int, ...] | None = None
    decode_cores: tuple[int, ...] | None = None
    colocated_cores: tuple[int, ...] | None = None
    router_cores: tuple[int, ...] | None = None
    # Prometheus /metrics: the router on this port (0: a free one), every node on a free port
    # of its own (listed when ready and in the state file); None: off.
    metrics_port: int | None = None
    # The router's OpenAI-compatible HTTP API on this port (0: a free one); None: off (--no-http).
    http_port: int | None = DEFAULT_HTTP_PORT
    # Written when the cluster serves, and again after every restart: the router's address
    # and each child's pid, gRPC address and metrics URL (cluster_state.py), for programs.
    state_file: str | None = None
    # A child that exits on its own is started again (cluster_supervisor.RestartPolicy).
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    ready_timeout_s: float = 180.0
    stop_grace_s: float = 10.0
    # SIGTERM to the launcher drains: the router (no new request, its streams finish), then every
    # node, each given this long (passed to each child as its own --drain-timeout-s).
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    poll_interval_s: float = 0.25
    probe_timeout_s: float = 1.0
    log_dir: str | None = None  # None: logs go to the console, prefixed by child name
    # Handed to every child; without it, children inherit $PDSERVE_AUTH_TOKEN (if set).
    auth_token_file: str | None = None
    # The router's client API keys (pdserve/common/api_keys.py); with them and no node credential the
    # launcher makes one for its children (cluster.py).
    api_keys_file: str | None = None
    # Mutual TLS among the children and TLS on the public API (pdserve/common/tls.py), handed to every
    # child: the user's files, or (`make_tls`, --tls) a private CA and certificate the launcher
    # makes for this cluster in `tls_dir` (cluster_tls.py; None: a new temporary directory).
    tls: TlsConfig | None = None
    make_tls: bool = False
    tls_dir: str | None = None
    # The planner's load mode (cluster_load_mode.py): nodes move between the prefill and decode
    # pools as the traffic's mix shifts; None: the pools keep their sizes.
    rebalance: LoadModeSettings | None = None

    def __post_init__(self) -> None:
        if self.num_colocated < 0:
            raise ValueError(f"--colocated must be >= 0, got {self.num_colocated}")
        if self.num_colocated and (self.num_prefill or self.num_decode):
            raise ValueError("--colocated runs both phases on every node; do not combine it with "
                             "prefill or decode nodes")
        if not self.num_colocated and (self.num_prefill < self.min_prefill or self.num_decode < 1):
            raise ValueError("a cluster needs at least 1 prefill and 1 decode node (or --colocated N; or "
                             "--prefill 0 with --decode-args --serve-prefill: decode nodes that also prefill)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"--http-port out of range: {self.http_port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port out of range: {self.metrics_port}")
        if self.host in ("0.0.0.0", "::", ""):
            raise ValueError("the local cluster needs a concrete host address (default 127.0.0.1), "
                             f"not {self.host!r}: nodes register it as the address to dial")
        for name in ("ready_timeout_s", "stop_grace_s", "poll_interval_s", "probe_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.drain_timeout_s < 0:
            raise ValueError(f"--drain-timeout-s must be >= 0, got {self.drain_timeout_s}")
        if self.make_tls and self.tls is not None:
            raise ValueError("--tls makes the cluster's own CA and certificate: give it, or --tls-cert-file, "
                             "--tls-key-file and --tls-ca-file, not both")
        if self.tls_dir is not None and not self.make_tls:
            raise ValueError("--tls-dir is where --tls writes its certificates: it needs --tls")
        _reject_owned_flags("--router-args", self.router_args, ROUTER_OWNED_FLAGS)
        if self.rebalance is not None:
            if self.num_colocated or self.num_prefill + self.num_decode < 3:
                raise ValueError("--rebalance moves nodes between the prefill and decode pools: it needs both "
                                 "pools and at least 3 nodes (with 2, 1 prefill + 1 decode is the only split)")
            if not self.min_prefill:  # its decode nodes prefill as well: there is no split to move
                raise ValueError("--rebalance moves nodes between the prefill and decode pools: decode nodes "
                                 "started with --serve-prefill are both already")
            if self.metrics_port is None:  # the load mode reads the router's /metrics: on, on a free port
                object.__setattr__(self, "metrics_port", 0)
        for pool in self.pools:
            _reject_owned_flags(f"--{pool.kind}-args", pool.args, NODE_OWNED_FLAGS)
            if pool.cores is not None and pool.count == 0:
                raise ValueError(f"{pool.cores_flag} given, but the cluster has no {pool.kind} nodes")
            if pool.cores is not None:
                split_cpus(pool.cores, pool.count, pool.cores_flag)  # raises when too few

    @property
    def min_prefill(self) -> int:
        """Decode nodes started with --serve-prefill are the prefill pool too: it may be empty."""
        return 0 if any(arg.split("=", 1)[0] == "--serve-prefill" for arg in self.decode_args) else 1

    @property
    def num_nodes(self) -> int:
        return self.num_prefill + self.num_decode + self.num_colocated

    @property
    def pools(self) -> tuple[Pool, ...]:
        """Every pool, in start order (a pool of 0 nodes included: its flags are still checked)."""
        return (Pool("prefill", self.num_prefill, self.prefill_args, self.prefill_cores),
                Pool("decode", self.num_decode, self.decode_args, self.decode_cores),
                Pool("colocated", self.num_colocated, self.colocated_args, self.colocated_cores))

    @property
    def node_counts(self) -> str:
        """"1 prefill, 2 decode" or "2 colocated": what the ready banner says."""
        return ", ".join(f"{pool.count} {pool.kind}" for pool in self.pools if pool.count)


@dataclass(frozen=True)
class Pool:
    """The nodes of one kind: how many, their pass-through flags, their cores (None: not pinned)."""

    kind: str
    count: int
    args: tuple[str, ...]
    cores: tuple[int, ...] | None

    @property
    def cores_flag(self) -> str:
        return f"--{self.kind}-cores"


def _reject_owned_flags(option: str, args: Sequence[str], owned: Sequence[str]) -> None:
    for arg in args:
        if arg.split("=", 1)[0] in owned:
            raise ValueError(f"{option} must not set {arg.split('=', 1)[0]}: the launcher sets it")


def cluster_parser() -> argparse.ArgumentParser:
    d = ClusterConfig()
    p = argparse.ArgumentParser(prog="pdserve cluster", description="Run a local pdserve cluster: "
                                "a router, N prefill nodes and M decode nodes (or N colocated nodes), "
                                "until Ctrl-C.")
    p.add_argument("--model", default=d.model, help="model directory (default: the built-in demo model)")
    # None: 1 each, or 0 each with --colocated.
    p.add_argument("--prefill", type=int, default=None, metavar="N", help=f"prefill nodes (default {d.num_prefill})")
    p.add_argument("--decode", type=int, default=None, metavar="M", help=f"decode nodes (default {d.num_decode})")
    p.add_argument("--colocated", type=int, default=d.num_colocated, metavar="N",
                   help="run N colocated nodes (both phases each: the baseline) instead of prefill and decode pools")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="router port (0: pick a free one)")
    add_config_args(p, EngineConfig, only=("dtype", "block_size"))  # every node's, the router's block size
    p.add_argument("--threads-per-node", type=int, default=d.threads_per_node)
    p.add_argument("--router-args", default="", metavar='"ARGS"', help="extra router flags")
    for pool in d.pools:
        p.add_argument(f"--{pool.kind}-args", default="", metavar='"ARGS"',
                       help=f"extra flags for every {pool.kind} node (one quoted string), "
                            f"e.g. \"--max-num-seqs 32 --num-blocks 1024\"")
    for pool in d.pools:
        p.add_argument(pool.cores_flag, type=cpu_list_arg(pool.cores_flag), default=None, metavar="LIST",
                       help=f"pin the {pool.kind} nodes to these cores (e.g. 0-3), split evenly among them; "
                            "each node runs one torch thread per core")
    p.add_argument("--router-cores", type=cpu_list_arg("--router-cores"), default=None, metavar="LIST",
                   help="pin the router to these cores")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port,
                   help="serve Prometheus /metrics: the router on this port (0: a free one), each node on a "
                        "free port of its own (all printed when ready); off by default")
    p.add_argument("--http-port", type=int, default=d.http_port,
                   help=f"serve the OpenAI-compatible HTTP API on the router at this port (0: a free one; "
                        f"default {d.http_port})")
    p.add_argument("--no-http", action="store_true", help="no HTTP API, gRPC only")
    p.add_argument("--state-file", default=d.state_file, metavar="PATH",
                   help="write the router address and every child's pid and addresses here (JSON) when ready "
                        "and after every restart")
    add_config_args(p.add_argument_group("restarts"), RestartPolicy, prefix="restart_")
    load_mode = p.add_argument_group("load mode (planner): nodes move between the pools as the traffic's mix shifts")
    load_mode.add_argument("--rebalance", action="store_true",
                           help="watch the router's metrics and move a node to the other pool when the simulator "
                                "predicts another prefill:decode split meets the SLOs better")
    add_config_args(load_mode, LoadModeSettings, prefix="rebalance_")
    p.add_argument("--ready-timeout-s", type=float, default=d.ready_timeout_s)
    p.add_argument("--stop-grace-s", type=float, default=d.stop_grace_s)
    p.add_argument("--drain-timeout-s", type=float, default=d.drain_timeout_s,
                   help="on SIGTERM the launcher drains the router, then every node, each given this long to "
                        "finish what it holds (also each child's own --drain-timeout-s); Ctrl-C stops at once")
    p.add_argument("--log-dir", default=d.log_dir, help="write one log file per child here instead of the console")
    add_auth_args(p)
    add_tls_args(p, server=True)
    p.add_argument("--tls", action="store_true",
                   help="make a private CA and a certificate for this cluster: mutual TLS between the router and "
                        "the nodes, TLS on the public API (the CA's path is printed, for clients)")
    p.add_argument("--tls-dir", metavar="DIR", default=None,
                   help="--tls: write the CA and certificate here (default: a new temporary directory, removed "
                        "when the cluster stops)")
    p.add_argument("--api-keys-file", metavar="PATH", default=None,
                   help="client API keys for the router's public API, one a line, reloaded when the file changes; "
                        "without --auth-token-file the launcher makes the node join credential itself")
    return p


# The flags whose value is other processes' flags, one quoted string.
PASS_THROUGH_FLAGS = ("--router-args", "--prefill-args", "--decode-args", "--colocated-args")


def _attach_pass_through_values(argv: Sequence[str]) -> list[str]:
    """`--decode-args --local-prefill` as `--decode-args=--local-prefill`: argparse takes a lone
    value that starts with `--` for a flag of its own and refuses the line ("expected one
    argument"), though it is what the user meant."""
    out, items = [], iter(argv)
    for arg in items:
        value = next(items, None) if arg in PASS_THROUGH_FLAGS else None
        out.append(arg if value is None else f"{arg}={value}")
    return out


def config_from_args(argv: Sequence[str] | None) -> ClusterConfig:
    args = cluster_parser().parse_args(_attach_pass_through_values(sys.argv[1:] if argv is None else argv))
    default_pool_size = 0 if args.colocated else 1
    return ClusterConfig(
        model=args.model, host=args.host, port=args.port, dtype=args.dtype, block_size=args.block_size,
        num_prefill=default_pool_size if args.prefill is None else args.prefill,
        num_decode=default_pool_size if args.decode is None else args.decode,
        num_colocated=args.colocated, threads_per_node=args.threads_per_node,
        router_args=tuple(shlex.split(args.router_args)), prefill_args=tuple(shlex.split(args.prefill_args)),
        decode_args=tuple(shlex.split(args.decode_args)), colocated_args=tuple(shlex.split(args.colocated_args)),
        prefill_cores=args.prefill_cores, decode_cores=args.decode_cores, colocated_cores=args.colocated_cores,
        router_cores=args.router_cores, ready_timeout_s=args.ready_timeout_s, stop_grace_s=args.stop_grace_s,
        drain_timeout_s=args.drain_timeout_s,
        log_dir=args.log_dir, auth_token_file=args.auth_token_file, api_keys_file=args.api_keys_file,
        metrics_port=args.metrics_port, tls=tls_from_args(args, server=True), make_tls=args.tls, tls_dir=args.tls_dir,
        http_port=None if args.no_http else args.http_port,
        state_file=args.state_file, restart=RestartPolicy(**values_from_args(args, RestartPolicy, "restart_")),
        rebalance=LoadModeSettings(**values_from_args(args, LoadModeSettings, "rebalance_")) if args.rebalance else None)

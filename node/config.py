"""Node configuration: every address, port, timeout and size of one node, defaults here.

Owns `NodeConfig` (a frozen value, validated at construction), the command-line flags
shared by `pdserve prefill`, `pdserve decode` and `pdserve colocated`, and the
derivation of the engine's and the KV transport's configs from it.

Must never: read the environment, hold live state, pick an address other than
127.0.0.1 unless the caller asked for one, or import torch (the front imports this
module; the engine's own fields are validated by `EngineConfig` in the core process).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from pdserve.common.auth import add_auth_args, token_from_cli
from pdserve.node.affinity import cpu_list_arg

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig
    from pdserve.kv_transfer import KVTransferConfig

NODE_KINDS = ("prefill", "decode", "colocated")
DTYPE_NAMES = ("auto", "bfloat16", "float32")  # engine/dtype_choice's, named without importing torch
MODEL_IMPLS = ("auto", "native", "transformers")  # engine/config's


@dataclass(frozen=True)
class NodeConfig:
    model: str
    kind: str = "prefill"
    # gRPC front; port 0 lets the OS pick (the node registers the real one).
    host: str = "127.0.0.1"
    port: int = 0
    router: str = "127.0.0.1:50051"
    node_id: str | None = None  # None: "<kind>-<host>:<port>" once the port is known
    # KV transport listener (the descriptor carries the real port).
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    # Engine. "auto": the engine core resolves it for its machine (engine/dtype_choice).
    dtype: str = "auto"
    model_impl: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    threads: int | None = None  # None: one per pinned core, or torch's default when not pinned
    # Cores as devices: the front and the engine core pin themselves to these (None: no pinning).
    cpus: tuple[int, ...] | None = None
    # A reservation (decode) or an unacknowledged transfer (prefill) lives at most this long.
    lease_s: float = 30.0
    # Decode: the id of a cancelled or expired reservation (its blocks are freed at once) is
    # refused as a new reservation for this many leases after the old one was made.
    retired_id_leases: float = 3.0
    # Registration with the router.
    heartbeat_interval_s: float = 0.5
    registry_rpc_timeout_s: float = 1.0
    # Queue bounds: beyond them a new request is refused RESOURCE_EXHAUSTED at once, not
    # queued. Waiting requests — prefill, colocated: in the scheduler's queue; decode:
    # reservations whose KV has not arrived plus preempted requests. Queued tokens
    # (prefill, colocated): tokens not yet computed, the work a new request would wait behind.
    max_waiting_requests: int = 256
    max_queued_tokens: int = 65536
    # Front <-> core.
    core_start_timeout_s: float = 300.0
    core_stop_timeout_s: float = 5.0
    # GetStats waits this long for a fresh snapshot from the core, then answers the latest
    # one the core pushed (it pushes one at most every stats_push_interval_s: after a step,
    # or while idle), so neither GetStats nor the heartbeat waits on a core in a long step.
    stats_timeout_s: float = 0.5
    stats_push_interval_s: float = 0.2
    # Fault drills and tests only: the core sleeps this long after every engine step.
    debug_step_delay_s: float = 0.0
    # Core loop: poll timeout while transfers are outstanding / while fully idle.
    busy_poll_ms: int = 1
    idle_poll_ms: int = 50
    # gRPC server shutdown grace.
    grace_s: float = 1.0
    # Prometheus /metrics on host (None: off; 0: the OS picks, printed on start); it serves
    # the latest stats the core pushed.
    metrics_port: int | None = None
    # Largest request message the gRPC server takes (gRPC refuses more: RESOURCE_EXHAUSTED).
    max_message_bytes: int = 4 << 20
    # Shared secret (common/auth.py) required of gRPC callers and KV peers, and sent to
    # the router; None: no authentication.
    auth_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _require(self.kind in NODE_KINDS, "kind", f"must be one of {NODE_KINDS}, got {self.kind!r}")
        _require(bool(self.host) and bool(self.kv_host), "host", "and kv_host must be non-empty")
        _require(0 <= self.port <= 65535 and 0 <= self.kv_port <= 65535, "port", "out of range")
        _require(self.metrics_port is None or 0 <= self.metrics_port <= 65535, "metrics_port", "out of range")
        _require(":" in self.router, "router", f"must be HOST:PORT, got {self.router!r}")
        _require(self.dtype in DTYPE_NAMES, "dtype", f"must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        _require(self.model_impl in MODEL_IMPLS, "model_impl", f"must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        for name in ("lease_s", "heartbeat_interval_s", "registry_rpc_timeout_s", "core_start_timeout_s",
                     "core_stop_timeout_s", "stats_timeout_s", "stats_push_interval_s", "grace_s"):
            _require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        _require(self.max_waiting_requests >= 1 and self.max_queued_tokens >= 1, "max_waiting_requests",
                 f"and max_queued_tokens must be >= 1, got {self.max_waiting_requests}, {self.max_queued_tokens}")
        _require(self.debug_step_delay_s >= 0, "debug_step_delay_s", f"must be >= 0, got {self.debug_step_delay_s}")
        _require(self.max_message_bytes >= 1024, "max_message_bytes", f"must be >= 1024, got {self.max_message_bytes}")
        _require(self.retired_id_leases >= 1, "retired_id_leases", f"must be >= 1, got {self.retired_id_leases}")
        _require(self.busy_poll_ms >= 0 and self.idle_poll_ms > 0, "idle_poll_ms", "must be > 0")
        _require(self.cpus is None or (len(self.cpus) > 0 and min(self.cpus) >= 0), "cpus",
                 f"must be a non-empty list of core numbers, got {self.cpus}")

    @property
    def retired_id_s(self) -> float:
        return self.retired_id_leases * self.lease_s

    def engine_config(self) -> EngineConfig:
        """Raises ValueError naming a bad engine field (the core reports it at startup)."""
        from pdserve.engine.config import EngineConfig

        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            model_impl=self.model_impl,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            kv_cache_bytes=self.kv_cache_bytes,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            num_threads=self.engine_threads,
        )

    @property
    def engine_threads(self) -> int | None:
        """torch threads of the engine: --threads, else one per pinned core, else torch's default."""
        if self.threads is not None:
            return self.threads
        return len(self.cpus) if self.cpus else None

    def transfer_config(self) -> KVTransferConfig:
        from pdserve.kv_transfer import KVTransferConfig

        # A push not acknowledged within the lease fails (and frees the prefill's blocks).
        return KVTransferConfig(host=self.kv_host, port=self.kv_port, transfer_timeout_s=self.lease_s,
                                auth_token=self.auth_token)

    def resolved_node_id(self, address: str) -> str:
        return self.node_id or f"{self.kind}-{address}"


def add_node_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `pdserve prefill`, `pdserve decode` and `pdserve colocated` (the CLI contract)."""
    d = NodeConfig(model="-")
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--port", type=int, default=d.port, help="0: the OS picks")
    parser.add_argument("--router", default=d.router, help="HOST:PORT of the router's Registry")
    parser.add_argument("--node-id", default=d.node_id)
    parser.add_argument("--kv-host", default=d.kv_host)
    parser.add_argument("--kv-port", type=int, default=d.kv_port)
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=d.dtype,
                        help="auto: bfloat16 where the CPU computes it natively (AMX, AVX512_BF16), else float32")
    parser.add_argument("--model-impl", choices=MODEL_IMPLS, default=d.model_impl,
                        help="auto: the native forward for llama/mistral/qwen2/qwen3, transformers otherwise")
    parser.add_argument("--block-size", type=int, default=d.block_size)
    capacity = parser.add_mutually_exclusive_group()
    capacity.add_argument("--num-blocks", type=int, default=d.num_blocks)
    capacity.add_argument("--kv-cache-bytes", type=int, default=d.kv_cache_bytes)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--threads", type=int, default=d.threads,
                        help="torch threads of the engine (default: one per --cpus core, else torch's default)")
    parser.add_argument("--cpus", type=cpu_list_arg("--cpus"), default=d.cpus, metavar="LIST",
                        help="pin the node (front and engine core) to these cores, e.g. 0-1 or 0,2-3")
    parser.add_argument("--lease-s", type=float, default=d.lease_s)
    parser.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                        help="requests waiting for compute; beyond: RESOURCE_EXHAUSTED at once")
    parser.add_argument("--max-queued-tokens", type=int, default=d.max_queued_tokens,
                        help="prefill, colocated: tokens not yet computed; beyond: RESOURCE_EXHAUSTED at once")
    parser.add_argument("--debug-step-delay-s", type=float, default=d.debug_step_delay_s,
                        help="fault drills and tests: sleep this long after every engine step")
    parser.add_argument("--metrics-port", type=int, default=d.metrics_port,
                        help="serve Prometheus /metrics on --host at this port (0: the OS picks); off by default")
    parser.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes,
                        help="largest request message; gRPC refuses a larger one with RESOURCE_EXHAUSTED")
    add_auth_args(parser)


def config_from_args(args: argparse.Namespace, kind: str, environ: Mapping[str, str] | None = None) -> NodeConfig:
    """`environ` is where `$PDSERVE_AUTH_TOKEN` is looked up (the node's main passes os.environ)."""
    names = {f.name for f in fields(NodeConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    token = token_from_cli(getattr(args, "auth_token_file", None), environ or {})
    return NodeConfig(kind=kind, auth_token=token, **values)


def parse_node_args(argv: list[str] | None, kind: str, environ: Mapping[str, str] | None = None) -> NodeConfig:
    """A bad value — a token file that is missing, empty or unreadable, a bound below 1 — is a
    usage error: one line naming it on stderr and exit status 2, as argparse's own errors."""
    parser = argparse.ArgumentParser(prog=f"pdserve {kind}", description=f"run a {kind} node")
    add_node_args(parser)
    args = parser.parse_args(argv)
    try:
        return config_from_args(args, kind, environ)
    except ValueError as exc:  # TokenError is one
        parser.error(str(exc))


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")

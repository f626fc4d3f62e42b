"""Node configuration: every address, port, timeout and size of one node, defaults here.

Owns `NodeConfig` (a frozen value, validated at construction), the command-line flags
shared by `pdserve prefill` and `pdserve decode`, and the derivation of the engine's and
the KV transport's configs from it.

Must never: read the environment, hold live state, pick an address other than
127.0.0.1 unless the caller asked for one, or import torch (the front imports this
module; the engine's own fields are validated by `EngineConfig` in the core process).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig
    from pdserve.kv_transfer import KVTransferConfig

NODE_KINDS = ("prefill", "decode")
DTYPE_NAMES = ("bfloat16", "float32")  # the engine's DTYPES, named without importing torch


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
    # Engine.
    dtype: str = "bfloat16"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    threads: int | None = None
    # A reservation (decode) or an unacknowledged transfer (prefill) lives at most this long.
    lease_s: float = 30.0
    # Decode: blocks of a cancelled or expired reservation stay held at most this many
    # leases after the reservation unless the prefill node's done message frees them first.
    quarantine_leases: float = 3.0
    # Registration with the router.
    heartbeat_interval_s: float = 0.5
    registry_rpc_timeout_s: float = 1.0
    # Front <-> core.
    core_start_timeout_s: float = 300.0
    core_stop_timeout_s: float = 5.0
    stats_timeout_s: float = 5.0
    # Core loop: poll timeout while transfers are outstanding / while fully idle.
    busy_poll_ms: int = 1
    idle_poll_ms: int = 50
    # gRPC server shutdown grace.
    grace_s: float = 1.0

    def __post_init__(self) -> None:
        _require(self.kind in NODE_KINDS, "kind", f"must be one of {NODE_KINDS}, got {self.kind!r}")
        _require(bool(self.host) and bool(self.kv_host), "host", "and kv_host must be non-empty")
        _require(0 <= self.port <= 65535 and 0 <= self.kv_port <= 65535, "port", "out of range")
        _require(":" in self.router, "router", f"must be HOST:PORT, got {self.router!r}")
        _require(self.dtype in DTYPE_NAMES, "dtype", f"must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        for name in ("lease_s", "heartbeat_interval_s", "registry_rpc_timeout_s", "core_start_timeout_s",
                     "core_stop_timeout_s", "stats_timeout_s", "grace_s"):
            _require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        _require(self.quarantine_leases >= 1, "quarantine_leases", f"must be >= 1, got {self.quarantine_leases}")
        _require(self.busy_poll_ms >= 0 and self.idle_poll_ms > 0, "idle_poll_ms", "must be > 0")

    @property
    def quarantine_s(self) -> float:
        return self.quarantine_leases * self.lease_s

    def engine_config(self) -> EngineConfig:
        """Raises ValueError naming a bad engine field (the core reports it at startup)."""
        from pdserve.engine.config import EngineConfig

        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            kv_cache_bytes=self.kv_cache_bytes,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            num_threads=self.threads,
        )

    def transfer_config(self) -> KVTransferConfig:
        from pdserve.kv_transfer import KVTransferConfig

        # A push not acknowledged within the lease fails (and frees the prefill's blocks).
        return KVTransferConfig(host=self.kv_host, port=self.kv_port, transfer_timeout_s=self.lease_s)

    def resolved_node_id(self, address: str) -> str:
        return self.node_id or f"{self.kind}-{address}"


def add_node_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `pdserve prefill` and `pdserve decode` (the CLI contract)."""
    d = NodeConfig(model="-")
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--port", type=int, default=d.port, help="0: the OS picks")
    parser.add_argument("--router", default=d.router, help="HOST:PORT of the router's Registry")
    parser.add_argument("--node-id", default=d.node_id)
    parser.add_argument("--kv-host", default=d.kv_host)
    parser.add_argument("--kv-port", type=int, default=d.kv_port)
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=d.dtype)
    parser.add_argument("--block-size", type=int, default=d.block_size)
    capacity = parser.add_mutually_exclusive_group()
    capacity.add_argument("--num-blocks", type=int, default=d.num_blocks)
    capacity.add_argument("--kv-cache-bytes", type=int, default=d.kv_cache_bytes)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--threads", type=int, default=d.threads)
    parser.add_argument("--lease-s", type=float, default=d.lease_s)


def config_from_args(args: argparse.Namespace, kind: str) -> NodeConfig:
    names = {f.name for f in fields(NodeConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    return NodeConfig(kind=kind, **values)


def parse_node_args(argv: list[str] | None, kind: str) -> NodeConfig:
    parser = argparse.ArgumentParser(prog=f"pdserve {kind}", description=f"run a {kind} node")
    add_node_args(parser)
    return config_from_args(parser.parse_args(argv), kind)


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")

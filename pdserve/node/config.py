"""Node configuration: one tree holding everything a node runs with, each default in one place.

    NodeConfig                 the node's own addresses, timeouts, queue bounds, cores
      ├─ engine: EngineConfig      every engine knob (pdserve/engine/config.py)
      └─ transfer: KVTransferConfig  the KV transport's (pdserve/kv_transfer/config.py; unused by colocated)

The command line of `pdserve prefill|decode|colocated` is derived from the tree
(pdserve/common/config_flags.py): an engine field is a flag by its own name (`--max-num-seqs`), a
transport field under `--kv-` (`--kv-port`), a node field by its own name (`--lease-s`).
Three transport fields are the node's facts and never flags: its secret is the node's
`auth_token`, a push must be acknowledged within the node's `lease_s`, and the corrupting
fault drill is the node's `--debug-corrupt-kv-push`.

Must never: read the environment, hold live state, pick an address other than 127.0.0.1
unless the caller asked for one, or import torch (the front imports this module; the
engine core resolves `dtype="auto"` on its own machine).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from pdserve.common.auth import add_auth_args, token_from_cli
from pdserve.common.config_flags import add_config_args, values_from_args
from pdserve.common.tls import TlsConfig, add_tls_args, tls_from_args
from pdserve.common.lifecycle import DEFAULT_DRAIN_TIMEOUT_S
from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer.config import KVTransferConfig
from pdserve.common.affinity import cpu_list_arg

POISON_ACTIONS = ("raise", "exit")  # pdserve/node/core/fault_drills.py

NODE_KINDS = ("prefill", "decode", "colocated")
TRANSFER_FLAG_PREFIX = "kv_"
# Transport fields a node sets from its own (see __post_init__), so never flags.
NODE_OWNED_TRANSFER_FIELDS = ("transfer_timeout_s", "auth_token", "debug_corrupt_push")


@dataclass(frozen=True)
class NodeConfig:
    engine: EngineConfig
    kind: str = field(default="prefill", metadata={"flag": False})
    # gRPC front; port 0 lets the OS pick (the node registers the real one).
    host: str = field(default="127.0.0.1", metadata={"help": "address of the gRPC front"})
    port: int = field(default=0, metadata={"help": "gRPC port (0: the OS picks)"})
    router: str = field(default="127.0.0.1:50051", metadata={"help": "HOST:PORT of the router's Registry"})
    node_id: str | None = field(default=None, metadata={"help": "default: <kind>-<host>:<port>"})
    # A decode node that also computes prompts of its own (a hybrid: the ColocatedNode service too).
    local_prefill: bool = field(default=False, metadata={
        "help": "decode nodes: also compute whole requests sent to this node's Generate (ColocatedNode) "
                "service, beside the requests whose KV a prefill node sends"})
    # A decode node that is also a prefill node for the others (the PrefillNode service too).
    serve_prefill: bool = field(default=False, metadata={
        "help": "decode nodes: also compute prompts for other decode nodes (the PrefillNode service) and "
                "send them their KV; implies --local-prefill. A pool of such nodes is colocated and "
                "disaggregated at once: the router picks per request (--disaggregation)"})
    transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    # Cores as devices: the front and the engine core pin themselves to these (None: no pinning).
    cpus: tuple[int, ...] | None = field(default=None, metadata={
        "parse": cpu_list_arg("--cpus"), "metavar": "LIST",
        "help": "pin the node (front and engine core) to these cores, e.g. 0-1 or 0,2-3; "
                "the engine then runs one torch thread per core unless --num-threads says otherwise"})
    # An unacknowledged transfer (prefill), or a reservation whose prefill node has gone silent
    # (decode), lives at most this long (pdserve/node/core/lease.py): the queue and the prefill do not count.
    lease_s: float = field(default=30.0, metadata={
        "help": "a KV push not yet acknowledged, or a decode reservation whose prefill node has not been heard "
                "from, lives at most this long"})
    # Decode: the id of a cancelled or expired reservation (its blocks are freed at once) is
    # refused as a new reservation for this many leases after the old one was made.
    retired_id_leases: float = 3.0
    # Registration with the router.
    heartbeat_interval_s: float = 0.5
    registry_rpc_timeout_s: float = 1.0
    # A prefill node's fetch of a decode node's KV layout (once per decode node run).
    kv_layout_timeout_s: float = 5.0
    # Queue bounds: beyond them a new request is refused RESOURCE_EXHAUSTED at once, not
    # queued. Waiting requests — prefill, colocated: in the scheduler's queue; decode:
    # reservations whose KV has not arrived plus preempted requests. Queued tokens
    # (prefill, colocated): tokens not yet computed, the work a new request would wait behind.
    max_waiting_requests: int = field(default=256, metadata={
        "help": "requests waiting for compute; beyond: RESOURCE_EXHAUSTED at once"})
    max_queued_tokens: int = field(default=65536, metadata={
        "help": "prefill, colocated: tokens not yet computed; beyond: RESOURCE_EXHAUSTED at once"})
    # Front <-> core.
    core_start_timeout_s: float = 300.0
    core_stop_timeout_s: float = 5.0
    # GetStats waits this long for a fresh snapshot from the core, then answers the latest
    # one the core pushed (it pushes one at most every stats_push_interval_s: after a step,
    # or while idle), so neither GetStats nor the heartbeat waits on a core in a long step.
    stats_timeout_s: float = 0.5
    stats_push_interval_s: float = 0.2
    # Fault drills and tests only: the core sleeps this long after every engine step.
    debug_step_delay_s: float = field(default=0.0, metadata={
        "help": "fault drills and tests: sleep this long after every engine step"})
    # ... and a step computing a prompt that holds this token fails as a model bug would.
    debug_poison_token_id: int | None = field(default=None, metadata={
        "help": "fault drills and tests: a step that computes a prompt holding this token id fails"})
    debug_poison_action: str = field(default="raise", metadata={
        "choices": POISON_ACTIONS,
        "help": "how a poisoned step fails: raise inside the step, or exit the engine core at once (a crash)"})
    # ... and the Nth KV push this node sends has a byte flipped after its checksum was taken
    # (pdserve/kv_transfer/integrity.py): its receiver refuses the request, which resumes elsewhere.
    debug_corrupt_kv_push: int = field(default=0, metadata={
        "help": "fault drills and tests: corrupt the Nth KV push this node sends (after its checksum); 0: none"})
    # Core loop: poll timeout while transfers are outstanding / while fully idle.
    busy_poll_ms: int = 1
    idle_poll_ms: int = 50
    # gRPC server shutdown grace.
    grace_s: float = 1.0
    # SIGTERM (pdserve/node/front/drain.py): leave placement at once, finish what the node holds.
    drain_timeout_s: float = field(default=DEFAULT_DRAIN_TIMEOUT_S, metadata={
        "help": "on SIGTERM: leave the router's placement at once and give the requests this node holds this "
                "long to finish (prefill: its queued prefills and their KV pushes); what still runs then is "
                "failed over, so the router resumes it on another node"})
    drain_poll_s: float = 0.1  # how often a draining node asks its core whether it still holds anything
    # Prometheus /metrics on host (None: off; 0: the OS picks, printed on start); it serves
    # the latest stats the core pushed.
    metrics_port: int | None = field(default=None, metadata={
        "help": "serve Prometheus /metrics on --host at this port (0: the OS picks); off by default"})
    # Largest request message the gRPC server takes (gRPC refuses more: RESOURCE_EXHAUSTED).
    max_message_bytes: int = field(default=4 << 20, metadata={
        "help": "largest request message; gRPC refuses a larger one with RESOURCE_EXHAUSTED"})
    # Shared secret (pdserve/common/auth.py) required of gRPC callers and KV peers, and sent to
    # the router; None: no authentication. Set from --auth-token-file or the environment.
    auth_token: str | None = field(default=None, repr=False, metadata={"flag": False})
    # Mutual TLS (pdserve/common/tls.py) on the gRPC server and every channel to the router and the other
    # nodes; None: plaintext. Set from --tls-cert-file, --tls-key-file and --tls-ca-file together.
    tls: TlsConfig | None = field(default=None, metadata={"flag": False})

    def __post_init__(self) -> None:
        _require(self.kind in NODE_KINDS, "kind", f"must be one of {NODE_KINDS}, got {self.kind!r}")
        for name in ("local_prefill", "serve_prefill"):
            _require(not getattr(self, name) or self.kind == "decode", name,
                     f"is for decode nodes (a {self.kind} node's own prompts are its kind's to say)")
        _require(bool(self.host), "host", "must be non-empty")
        _require(0 <= self.port <= 65535, "port", "out of range")
        _require(self.metrics_port is None or 0 <= self.metrics_port <= 65535, "metrics_port", "out of range")
        _require(":" in self.router, "router", f"must be HOST:PORT, got {self.router!r}")
        for name in ("lease_s", "heartbeat_interval_s", "registry_rpc_timeout_s", "kv_layout_timeout_s",
                     "core_start_timeout_s", "core_stop_timeout_s", "stats_timeout_s", "stats_push_interval_s",
                     "grace_s", "drain_poll_s"):
            _require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        _require(self.max_waiting_requests >= 1 and self.max_queued_tokens >= 1, "max_waiting_requests",
                 f"and max_queued_tokens must be >= 1, got {self.max_waiting_requests}, {self.max_queued_tokens}")
        _require(self.drain_timeout_s >= 0, "drain_timeout_s", f"must be >= 0, got {self.drain_timeout_s}")
        _require(self.debug_corrupt_kv_push >= 0, "debug_corrupt_kv_push",
                 f"must be >= 0, got {self.debug_corrupt_kv_push}")
        _require(self.debug_step_delay_s >= 0, "debug_step_delay_s", f"must be >= 0, got {self.debug_step_delay_s}")
        _require(self.max_message_bytes >= 1024, "max_message_bytes", f"must be >= 1024, got {self.max_message_bytes}")
        _require(self.retired_id_leases >= 1, "retired_id_leases", f"must be >= 1, got {self.retired_id_leases}")
        if self.tls is not None and self.auth_token is None and self.kind != "colocated":
            # Neither KV transport runs TLS here: the join credential is what keeps a stranger off the KV listener.
            raise ValueError("--tls-cert-file: a prefill or decode node's KV data plane (UCX, torch) runs no TLS; it "
                             "is authenticated by the node join credential instead, so TLS needs one: "
                             "--auth-token-file or $PDSERVE_AUTH_TOKEN")
        _require(self.busy_poll_ms >= 0 and self.idle_poll_ms > 0, "idle_poll_ms", "must be > 0")
        _require(self.cpus is None or (len(self.cpus) > 0 and min(self.cpus) >= 0), "cpus",
                 f"must be a non-empty list of core numbers, got {self.cpus}")
        # The node's facts, set here once so every reader of the subtrees sees them.
        # (A tensor-parallel node's ranks each take their share of the cores: pdserve/ranks/tp_group.py.)
        if self.engine.num_threads is None and self.cpus and self.engine.tensor_parallel_size == 1:
            object.__setattr__(self, "engine", replace(self.engine, num_threads=len(self.cpus)))
        object.__setattr__(self, "transfer", replace(self.transfer, transfer_timeout_s=self.lease_s,
                                                     auth_token=self.auth_token,
                                                     debug_corrupt_push=self.debug_corrupt_kv_push))

    @property
    def model(self) -> str:
        return self.engine.model

    @property
    def retired_id_s(self) -> float:
        return self.retired_id_leases * self.lease_s

    def resolved_node_id(self, address: str) -> str:
        return self.node_id or f"{self.kind}-{address}"


def add_node_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `pdserve prefill`, `pdserve decode` and `pdserve colocated` (the CLI contract)."""
    add_config_args(parser.add_argument_group("engine"), EngineConfig)
    add_config_args(parser.add_argument_group("node"), NodeConfig)
    add_config_args(parser.add_argument_group("KV transfer"), KVTransferConfig, prefix=TRANSFER_FLAG_PREFIX,
                    skip=NODE_OWNED_TRANSFER_FIELDS)
    add_auth_args(parser)
    add_tls_args(parser, server=True)


def config_from_args(args: argparse.Namespace, kind: str, environ: Mapping[str, str] | None = None) -> NodeConfig:
    """`environ` is where `$PDSERVE_AUTH_TOKEN` is looked up (the node's main passes os.environ)."""
    token = token_from_cli(getattr(args, "auth_token_file", None), environ or {})
    return NodeConfig(
        engine=EngineConfig(**values_from_args(args, EngineConfig)),
        transfer=KVTransferConfig(**values_from_args(args, KVTransferConfig, TRANSFER_FLAG_PREFIX,
                                                     skip=NODE_OWNED_TRANSFER_FIELDS)),
        kind=kind, auth_token=token, tls=tls_from_args(args, server=True), **values_from_args(args, NodeConfig),
    )


def parse_node_args(argv: list[str] | None, kind: str, environ: Mapping[str, str] | None = None) -> NodeConfig:
    """A bad value — a token file that is missing, empty or unreadable, a bound below 1 — is a
    usage error: one line naming it on stderr and exit status 2, as argparse's own errors."""
    parser = argparse.ArgumentParser(prog=f"pdserve {kind}", description=f"run a {kind} node")
    add_node_args(parser)
    args = parser.parse_args(argv)
    try:
        return config_from_args(args, kind, environ)
    except ValueError as exc:  # TokenError and TlsError are
        parser.error(str(exc))


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")

"""Router configuration: every address, timeout and size of the router, with its default in one place.

Owns `RouterConfig` and the `host:port` parsing the router's flags use. It never opens
a socket and never reads the model directory.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051


@dataclass(frozen=True)
class RouterConfig:
    model: str
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT  # 0: the OS picks; the server reports the bound port
    # Static node addresses (polled with GetStats); nodes may also register themselves.
    prefill_addresses: tuple[str, ...] = ()
    decode_addresses: tuple[str, ...] = ()
    # A node silent (no heartbeat, no answered GetStats) this long is dropped.
    # Ten missed heartbeats (nodes send one every 0.5 s): a node whose front is starved
    # of CPU by its own engine core on a small machine is slow, not dead.
    heartbeat_timeout_s: float = 5.0
    # Told to nodes when they register.
    heartbeat_interval_ms: int = 500
    # How often the registry drops silent nodes and polls static ones.
    maintenance_interval_s: float = 0.25
    stats_poll_timeout_s: float = 1.0
    # Must match the nodes' block size: prefix-affinity hashes whole blocks.
    block_size: int = 16
    # A prefill node holding the prompt's prefix wins while its queue is at most this
    # many tokens longer than the shortest queue.
    affinity_slack_tokens: int = 2048
    max_affinity_entries: int = 1 << 16
    # A decode node that refused for lack of blocks is skipped until its next stats,
    # or this long at most.
    exhausted_cooldown_s: float = 1.0
    # Node calls: how long a decode node may take to reserve, a prefill node to answer.
    ready_timeout_s: float = 30.0
    prefill_timeout_s: float = 600.0
    # After a decode stream's last event, how long to wait for its end before cancelling.
    stream_end_grace_s: float = 1.0
    max_n: int = 64
    shutdown_grace_s: float = 5.0
    # How long in-flight calls on a dropped node's channel may finish before it closes.
    channel_close_grace_s: float = 5.0

    def __post_init__(self) -> None:
        for address in (*self.prefill_addresses, *self.decode_addresses):
            parse_address(address)
        checks = [
            (0 <= self.port <= 65535, "port", "must be in [0, 65535]", self.port),
            (self.heartbeat_timeout_s > 0, "heartbeat_timeout_s", "must be > 0", self.heartbeat_timeout_s),
            (self.heartbeat_interval_ms > 0, "heartbeat_interval_ms", "must be > 0", self.heartbeat_interval_ms),
            (self.block_size >= 1, "block_size", "must be >= 1", self.block_size),
            (self.affinity_slack_tokens >= 0, "affinity_slack_tokens", "must be >= 0", self.affinity_slack_tokens),
            (self.max_n >= 1, "max_n", "must be >= 1", self.max_n),
        ]
        for ok, field, rule, value in checks:
            if not ok:
                raise ValueError(f"{field} {rule}, got {value}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' → (host, port); ValueError naming the address otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"address must be HOST:PORT with a port in [1, 65535], got {address!r}")
    return host, int(port)


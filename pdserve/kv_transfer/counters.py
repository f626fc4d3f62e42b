"""What a transport counts: `TransferStats`, the one type for KV transfer counters.

A transport keeps one for what it sent and one for what it received and placed; a node
reports the side that describes its work (pdserve/node/core/stats.py) in its stats snapshot, which
the front relays to the router and to `/metrics` as this same type.

Must never: import torch or a network library (a node's front imports this module).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(slots=True)
class TransferStats:
    """Counters of completed work; `latency_s` sums push()-to-ack time of successes."""

    bytes: int = 0
    blocks: int = 0
    transfers: int = 0
    failures: int = 0
    latency_s: float = 0.0
    checksum_failures: int = 0  # received pushes whose bytes did not match the sender's digests

    def record_success(self, nbytes: int, num_blocks: int, latency_s: float) -> None:
        self.bytes += nbytes
        self.blocks += num_blocks
        self.transfers += 1
        self.latency_s += latency_s

    def record_failure(self) -> None:
        self.failures += 1

    def record_checksum_failure(self) -> None:
        self.checksum_failures += 1

    def snapshot(self) -> TransferStats:
        return replace(self)

    @property
    def mean_latency_s(self) -> float:
        return self.latency_s / self.transfers if self.transfers else 0.0


def sum_stats(parts: list[TransferStats]) -> TransferStats:
    """Counters of several transports as one (a node's ranks)."""
    total = TransferStats()
    for part in parts:
        total.bytes += part.bytes
        total.blocks += part.blocks
        total.transfers += part.transfers
        total.failures += part.failures
        total.latency_s += part.latency_s
        total.checksum_failures += part.checksum_failures
    return total

"""KV-cache transfer between prefill and decode ranks.

Owns the transport interface (`KVTransport`), its value types, the head-overlap plan and
two implementations: `InProcessTransport` (unit tests) and `UcxTransport` (ucxx; imported
lazily so that importing this package never starts UCX).

Must never: pickle network data, or block the engine's step loop on the network.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import (KV_LAYOUT_VERSION, FingerprintMismatch, HeadOverlap, KVCacheSpec,
                   KVDescriptor, KVTransferError, KVTransport, TransferHandle,
                   TransferState, TransferStats, WritePermits, plan_head_overlap)
from .config import KVTransferConfig
from .inprocess import InProcessFabric, InProcessTransport

if TYPE_CHECKING:
    from .ucx import UcxTransport

__all__ = [
    "KV_LAYOUT_VERSION", "FingerprintMismatch", "HeadOverlap", "InProcessFabric",
    "InProcessTransport", "KVCacheSpec", "KVDescriptor", "KVTransferConfig",
    "KVTransferError", "KVTransport", "TransferHandle", "TransferState", "TransferStats",
    "UcxTransport", "WritePermits", "plan_head_overlap",
]


def __getattr__(name: str) -> object:
    if name == "UcxTransport":
        from .ucx import UcxTransport

        return UcxTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

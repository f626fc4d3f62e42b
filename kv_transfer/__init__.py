"""KV-cache transfer between prefill and decode ranks.

Owns the transport interface (`KVTransport`), its value types, the head-overlap plan and
two implementations: `InProcessTransport` (unit tests) and `UcxTransport` (ucxx).

Every name below is imported on first use (PEP 562), so importing this package, or its
torch-free `counters` module from a node's front, loads neither torch nor UCX.

Must never: pickle network data, or block the engine's step loop on the network.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import (KV_LAYOUT_VERSION, FingerprintMismatch, HeadOverlap, KVCacheSpec, KVDescriptor,
                       KVTransferError, KVTransport, TransferHandle, TransferState, WritePermits,
                       plan_head_overlap)
    from .config import KVTransferConfig
    from .counters import TransferStats
    from .inprocess import InProcessFabric, InProcessTransport
    from .ucx import UcxTransport

# name -> the module of this package that defines it
_HOMES = {
    **dict.fromkeys(("KV_LAYOUT_VERSION", "FingerprintMismatch", "HeadOverlap", "KVCacheSpec", "KVDescriptor",
                     "KVTransferError", "KVTransport", "TransferHandle", "TransferState", "WritePermits",
                     "plan_head_overlap"), ".base"),
    "KVTransferConfig": ".config",
    "TransferStats": ".counters",
    "InProcessFabric": ".inprocess",
    "InProcessTransport": ".inprocess",
    "UcxTransport": ".ucx",
}

__all__ = [
    "KV_LAYOUT_VERSION", "FingerprintMismatch", "HeadOverlap", "InProcessFabric", "InProcessTransport",
    "KVCacheSpec", "KVDescriptor", "KVTransferConfig", "KVTransferError", "KVTransport", "TransferHandle",
    "TransferState", "TransferStats", "UcxTransport", "WritePermits", "plan_head_overlap",
]


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home, __name__), name)

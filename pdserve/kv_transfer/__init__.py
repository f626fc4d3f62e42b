"""KV-cache transfer between prefill and decode ranks.

Owns the transport interface (`KVTransport`), its value types, the head-overlap plan and
three implementations: `InProcessTransport` (unit tests), `UcxTransport` (ucxx) and
`TorchTransport` (torch.distributed: gloo or NCCL); `make_transport` picks the configured one.

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
    from .torch_dist import TorchTransport
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
    "TorchTransport": ".torch_dist",
}

__all__ = [
    "KV_LAYOUT_VERSION", "FingerprintMismatch", "HeadOverlap", "InProcessFabric", "InProcessTransport",
    "KVCacheSpec", "KVDescriptor", "KVTransferConfig", "KVTransferError", "KVTransport", "TransferHandle",
    "make_transport",
    "TorchTransport", "TransferState", "TransferStats", "UcxTransport", "WritePermits", "plan_head_overlap",
]


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home, __name__), name)


def make_transport(config: KVTransferConfig) -> KVTransport:
    """The transport `config.transport` names (UCX starts in this process only when it is chosen)."""
    if config.transport == "torch":
        from .torch_dist import TorchTransport

        return TorchTransport(config)
    from .ucx import UcxTransport

    return UcxTransport(config)

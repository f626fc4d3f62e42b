"""KV-cache transfer between prefill and decode ranks.

Owns the transport interface (`KVTransport`), its value types, the head-overlap plan and
two implementations: `InProcessTransport` (unit tests) and `UcxTransport` (ucxx; imported
lazily so that importing this package never starts UCX).

Must never: pickle network data, or block the engine's step loop on the network.
"""

from __future__ import annotations

import importlib
# Each name, loaded from its module on first use: a node's front reads `KVTransferConfig`
# without importing torch (base, inprocess) or UCX (ucx).
_HOMES = {
    "config": ("KVTransferConfig",),
    "base": ("KV_LAYOUT_VERSION", "FingerprintMismatch", "HeadOverlap", "KVCacheSpec", "KVDescriptor",
             "KVTransferError", "KVTransport", "TransferHandle", "TransferState", "TransferStats",
             "WritePermits", "plan_head_overlap"),
    "inprocess": ("InProcessFabric", "InProcessTransport"),
    "ucx": ("UcxTransport",),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)

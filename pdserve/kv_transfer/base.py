"""The transport seam: what a KV cache looks like to a transfer, and what moving it means.

Owns the value types every transport shares (`KVCacheSpec` and its fingerprint,
`KVDescriptor`, `TransferState`, `TransferHandle`; the counters are `TransferStats` of
counters.py), the receiver's `WritePermits`, the head-range planning rule
(`plan_head_overlap`) and the `KVTransport` interface.

A push's life, on the sending side:

    push() ──▶ PENDING ──▶ TRANSFERRING ──▶ SUCCESS   (receiver placed the bytes and acked)
                                   └──────▶ FAILED    (peer dead, refused, or timed out)

The receiving side sees the bytes land in the blocks it reserved, then the request's
completion message (`send_done`), never the other way round. A receiver that owns its
blocks per request (the decode node) hands its transport `WritePermits`: a push is then
placed only into blocks its request holds a permit for, and dropped otherwise.

Must never: import a network library, pickle anything, or block the caller of `push`.
"""

from __future__ import annotations

import enum
import json
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from .counters import TransferStats

KV_LAYOUT_VERSION = 1  # [num_blocks, num_kv_heads, block_size, head_dim], heads-major

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

FINGERPRINT_FIELDS = ("model", "dtype", "num_layers", "num_kv_heads", "head_dim",
                      "block_size", "layout_version")


class KVTransferError(RuntimeError):
    """A transfer could not be set up or carried out."""


class FingerprintMismatch(KVTransferError):
    """Two nodes' KV caches are laid out differently; moving bytes would be garbage."""

    def __init__(self, diffs: dict[str, tuple[object, object]], context: str = "") -> None:
        self.diffs = dict(diffs)
        parts = [f"{name}: local={local!r} remote={remote!r}"
                 for name, (local, remote) in self.diffs.items()]
        prefix = f"{context}: " if context else ""
        # "auto" resolves per machine: nodes on CPUs with and without native bf16 differ.
        hint = "; set the same --dtype (float32 or bfloat16) on every node" if "dtype" in self.diffs else ""
        if "transport" in self.diffs:
            hint += "; set the same --kv-transport (ucx or torch) on every prefill and decode node"
        super().__init__(f"{prefix}KV cache fingerprint mismatch ({'; '.join(parts)}){hint}")


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unsupported KV dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class KVCacheSpec:
    """What this rank's KV cache is. Everything but `head_range` must match a peer's."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int  # the model's total; this rank holds head_range of them
    head_dim: int
    block_size: int
    layout_version: int = KV_LAYOUT_VERSION
    head_range: tuple[int, int] | None = None  # None: all heads

    def __post_init__(self) -> None:
        dtype_from_name(self.dtype)
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be > 0")
        start, end = self.head_range if self.head_range is not None else (0, self.num_kv_heads)
        if not 0 <= start < end <= self.num_kv_heads:
            raise ValueError(f"KVCacheSpec.head_range {self.head_range} not within "
                             f"[0, {self.num_kv_heads}]")
        # Normalised so that equal specs compare equal after a JSON round trip.
        object.__setattr__(self, "head_range", (int(start), int(end)))

    @property
    def local_heads(self) -> tuple[int, int]:
        """The global KV-head range [start, end) whose cache this rank holds."""
        assert self.head_range is not None  # normalised in __post_init__
        return self.head_range

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    def block_nbytes(self, num_heads: int) -> int:
        """Bytes of one block of one of K or V for `num_heads` heads."""
        return num_heads * self.block_size * self.head_dim * self.torch_dtype.itemsize

    def fingerprint(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in FINGERPRINT_FIELDS}

    def check_compatible(self, remote: dict[str, object], context: str = "") -> None:
        """Raise FingerprintMismatch naming every field that differs from `remote`."""
        local = self.fingerprint()
        diffs = {name: (local[name], remote.get(name)) for name in FINGERPRINT_FIELDS
                 if local[name] != remote.get(name)}
        if diffs:
            raise FingerprintMismatch(diffs, context)

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["head_range"] = list(self.local_heads)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> KVCacheSpec:
        fields = dict(data)
        if fields.get("head_range") is not None:
            fields["head_range"] = tuple(fields["head_range"])
        return cls(**fields)


@dataclass(frozen=True)
class KVDescriptor:
    """How to reach a registered cache: JSON on the wire, never pickle."""

    transport: str
    address: str
    port: int
    num_blocks: int
    spec: KVCacheSpec
    # UCX: peers connect to the worker's address (hex), first message on `hello_tag`, the
    # tag that names this transport among those sharing the process's worker.
    worker_address: str = ""
    hello_tag: int = 0

    @property
    def name(self) -> str:
        """How peers name this cache: address:port, and the HELLO tag where there is one
        (UCX's port is 0 where the OS picks it; the tag tells transports apart)."""
        base = f"{self.address}:{self.port}"
        return f"{base}/{self.hello_tag:x}" if self.hello_tag else base

    def to_bytes(self) -> bytes:
        data = {"transport": self.transport, "address": self.address, "port": self.port,
                "num_blocks": self.num_blocks, "spec": self.spec.to_dict(),
                "worker_address": self.worker_address, "hello_tag": self.hello_tag}
        return json.dumps(data, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> KVDescriptor:
        data = json.loads(raw)
        return cls(transport=str(data["transport"]), address=str(data["address"]),
                   port=int(data["port"]), num_blocks=int(data["num_blocks"]),
                   spec=KVCacheSpec.from_dict(data["spec"]),
                   worker_address=str(data.get("worker_address", "")),
                   hello_tag=int(data.get("hello_tag", 0)))


@dataclass(frozen=True)
class HeadOverlap:
    """The KV heads one rank pair moves: global range, and the slice of each local cache."""

    heads: tuple[int, int]  # global [start, end)
    src: tuple[int, int]    # slice of the sender's cache head axis
    dst: tuple[int, int]    # slice of the receiver's cache head axis

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]


def plan_head_overlap(src_range: tuple[int, int],
                      dst_range: tuple[int, int]) -> HeadOverlap | None:
    """Intersect the sender's and receiver's global KV-head ranges; None when disjoint."""
    start = max(src_range[0], dst_range[0])
    end = min(src_range[1], dst_range[1])
    if start >= end:
        return None
    return HeadOverlap(heads=(start, end),
                       src=(start - src_range[0], end - src_range[0]),
                       dst=(start - dst_range[0], end - dst_range[0]))


class TransferState(enum.Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"


@dataclass(eq=False)
class TransferHandle:
    """The sender's view of one push or done message; `poll()` never blocks.

    Transports move it forward with `_start()` / `_finish()` from their own thread; the
    first terminal state wins (a late ack after a timeout changes nothing).
    """

    req_id: str
    nbytes: int = 0
    num_blocks: int = 0
    created_at: float = field(default_factory=time.monotonic)
    error: str | None = field(default=None, init=False)
    finished_at: float | None = field(default=None, init=False)
    _state: TransferState = field(default=TransferState.PENDING, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _done: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _callbacks: list[Callable[[TransferHandle], None]] = field(default_factory=list, init=False, repr=False)

    def add_done_callback(self, callback: Callable[[TransferHandle], None]) -> None:
        """Call `callback(handle)` once it ends (at once if it has), on the thread that ends it."""
        with self._lock:
            if not self.done:
                self._callbacks.append(callback)
                return
        callback(self)

    def poll(self) -> TransferState:
        return self._state

    @property
    def done(self) -> bool:
        return self._state in (TransferState.SUCCESS, TransferState.FAILED)

    def wait(self, timeout: float | None = None) -> TransferState:
        """Block until terminal or `timeout`; for tests and benchmarks, not the step loop."""
        self._done.wait(timeout)
        return self._state

    def _start(self) -> bool:
        with self._lock:
            if self._state is not TransferState.PENDING:
                return False
            self._state = TransferState.TRANSFERRING
            return True

    def _finish(self, state: TransferState, error: str | None = None) -> bool:
        with self._lock:
            if self.done:
                return False
            self._state = state
            self.error = error
            self.finished_at = time.monotonic()
            callbacks, self._callbacks = self._callbacks, []
        self._done.set()
        for callback in callbacks:
            callback(self)
        return True


DoneCallback = Callable[[str, bytes], None]


class PermitFollower(Protocol):
    """Mirrors a `WritePermits`: granted before the grant returns, revoked in order with it."""

    def grant(self, req_id: str, block_ids: Sequence[int]) -> None: ...

    def revoke(self, req_id: str) -> None: ...


class WritePermits:
    """Which blocks a push for each request may write on the receiving rank (thread-safe).

    The blocks' owner grants a request its blocks before it names them to any sender and
    revokes the grant before it frees or reuses them. The transport writes a push's bytes
    (one call of `write`, e.g. a chunk's scatter) only under `place`, which holds the
    lock while it writes: once `revoke` returns, no byte for that request can land, so
    its blocks may be freed at once, whoever might still be sending.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._granted: dict[str, frozenset[int]] = {}
        self._followers: list[PermitFollower] = []

    def follow(self, follower: PermitFollower) -> None:
        """Tell `follower` every grant and revoke from now on (a node's other ranks' permits)."""
        self._followers.append(follower)

    def grant(self, req_id: str, block_ids: Sequence[int]) -> None:
        with self._lock:
            self._granted[req_id] = frozenset(block_ids)
        for follower in self._followers:
            follower.grant(req_id, block_ids)

    def revoke(self, req_id: str) -> None:
        """After this returns, `place` writes nothing for `req_id` (idempotent)."""
        with self._lock:
            self._granted.pop(req_id, None)
        for follower in self._followers:
            follower.revoke(req_id)

    def place(self, req_id: str, dst_block_ids: Sequence[int], write: Callable[[], None]) -> bool:
        """Run `write` if `req_id` holds every block in `dst_block_ids`; False: dropped."""
        with self._lock:
            granted = self._granted.get(req_id)
            if granted is None or not granted.issuperset(dst_block_ids):
                return False
            write()  # under the lock: a concurrent revoke waits for this write to end
            return True


class KVTransport(ABC):
    """Moves KV blocks of a request from this rank's cache into a peer's reserved blocks.

    `register` once, `connect` to each peer (fingerprints are checked both ways), then
    `push` per finished chunk and `send_done` once per request. A receiver learns of a
    request's completion from `poll_done()` or the done callback, always after its bytes.
    """

    @abstractmethod
    def register(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
                 spec: KVCacheSpec) -> KVDescriptor:
        """Expose this rank's per-layer caches `[num_blocks, heads, block_size, head_dim]`."""

    @abstractmethod
    def descriptor(self) -> KVDescriptor:
        """This rank's descriptor (after `register`), to hand to peers."""

    @abstractmethod
    def connect(self, remote: KVDescriptor) -> str:
        """Handshake with a peer; returns its peer id. Raises FingerprintMismatch."""

    @abstractmethod
    def push(self, req_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
             layers: Sequence[int] | None = None, head_range: tuple[int, int] | None = None,
             *, peer: str | None = None) -> TransferHandle:
        """Start copying src blocks into the peer's dst blocks; returns at once.

        `layers` defaults to all; `head_range` (global) defaults to the overlap of both
        ranks' heads. `peer` may be omitted when exactly one peer is connected.
        """

    @abstractmethod
    def send_done(self, req_id: str, payload: bytes, *, peer: str | None = None
                  ) -> TransferHandle:
        """Queue the request's completion message behind its pushes to that peer."""

    @abstractmethod
    def poll_done(self) -> list[tuple[str, bytes]]:
        """Drain completion messages received so far, in arrival order."""

    @abstractmethod
    def set_done_callback(self, callback: DoneCallback | None) -> None:
        """Also call `callback(req_id, payload)` on each completion (transport thread)."""

    @abstractmethod
    def guard_writes(self, permits: WritePermits) -> None:
        """From now on, place a received push only as `permits` allow; drop it otherwise.

        A dropped push is drained and acknowledged like a placed one (its sender's request
        is over here; failing the push would make the sender drop the whole connection),
        and is not counted in `recv_stats`. Without permits every valid push is placed.
        """

    @abstractmethod
    def stats(self) -> TransferStats:
        """Counters of what this rank sent (pushes only)."""

    @abstractmethod
    def recv_stats(self) -> TransferStats:
        """Counters of what this rank received and placed."""

    @abstractmethod
    def handshake_refusals(self) -> list[FingerprintMismatch]:
        """Incoming connections this rank refused, as errors naming the fields."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving; in-flight handles end FAILED."""

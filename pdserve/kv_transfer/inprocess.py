"""In-process KV transport: endpoints in one process, joined by a fabric, copying tensors.

For unit tests of the prefill/decode state machines without a network. It runs the same
plan, staging layout, fingerprint handshake and counters as the UCX transport, and is
deterministic: nothing moves until `progress()` (or on every call, with
`auto_progress=True`). Each `progress()` moves each queued job one step, in queue order:

    push()      -> PENDING
    progress()  -> TRANSFERRING   (source blocks gathered into staging)
    progress()  -> SUCCESS        (receiver validated and scattered) | FAILED

A done message waits behind the pushes queued before it, so the receiver sees it after
their bytes. `InProcessFabric.kill(address)` makes a peer vanish mid-flight. A receiver
with `guard_writes(permits)` drops (and still succeeds) a push its permits refuse.

Must never: spawn threads, sleep, or touch a socket.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import (DoneCallback, FingerprintMismatch, KVCacheSpec, KVDescriptor,
                   KVTransferError, KVTransport, TransferHandle, TransferState,
                   TransferStats, WritePermits)
from .ledger import DoneQueue
from .layout import (TransferPlan, check_block_ids, check_layers, gather, make_plan,
                     scatter, staging_shape, validate_caches)


class InProcessFabric:
    """Stands in for the network: who is reachable at which address."""

    def __init__(self) -> None:
        self._nodes: dict[str, InProcessTransport] = {}
        self._dead: set[str] = set()

    def attach(self, address: str, node: InProcessTransport) -> None:
        if address in self._nodes and address not in self._dead:
            raise ValueError(f"address {address!r} already in use")
        self._nodes[address] = node
        self._dead.discard(address)

    def lookup(self, address: str) -> InProcessTransport | None:
        """The live node at `address`, or None when it is unknown or dead."""
        return None if address in self._dead else self._nodes.get(address)

    def kill(self, address: str) -> None:
        self._dead.add(address)


@dataclass(slots=True)
class _Job:
    peer: str
    handle: TransferHandle
    plan: TransferPlan | None = None  # None: a done message
    payload: bytes = b""
    staging: torch.Tensor | None = None


class InProcessTransport(KVTransport):
    def __init__(self, address: str, fabric: InProcessFabric, *,
                 auto_progress: bool = False) -> None:
        self.address = address
        self._fabric = fabric
        self._auto = auto_progress
        self._spec: KVCacheSpec | None = None
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._num_blocks = 0
        self._peers: dict[str, KVDescriptor] = {}
        self._jobs: deque[_Job] = deque()
        self._dones = DoneQueue()
        self._permits: WritePermits | None = None
        self._sent = TransferStats()
        self._received = TransferStats()
        self._refusals: list[FingerprintMismatch] = []

    # -- setup -----------------------------------------------------------------------
    def register(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
                 spec: KVCacheSpec) -> KVDescriptor:
        self._num_blocks = validate_caches(k_caches, v_caches, spec)
        self._k, self._v, self._spec = list(k_caches), list(v_caches), spec
        self._fabric.attach(self.address, self)
        return self.descriptor()

    def descriptor(self) -> KVDescriptor:
        if self._spec is None:
            raise KVTransferError("register() the caches first")
        return KVDescriptor(transport="inprocess", address=self.address, port=0,
                            num_blocks=self._num_blocks, spec=self._spec)

    def connect(self, remote: KVDescriptor) -> str:
        local = self.descriptor()
        node = self._fabric.lookup(remote.address)
        if node is None:
            raise KVTransferError(f"no live peer at {remote.address!r}")
        # Both sides check: the listener records its refusal, the connector raises.
        accepted = node._accept(local)
        local.spec.check_compatible(accepted.spec.fingerprint(), f"peer {remote.address}")
        self._peers[remote.address] = accepted
        return remote.address

    def _accept(self, remote: KVDescriptor) -> KVDescriptor:
        """Listener side of the handshake: record a refusal, answer with our descriptor."""
        local = self.descriptor()
        try:
            local.spec.check_compatible(remote.spec.fingerprint(),
                                        f"refused peer {remote.address}")
        except FingerprintMismatch as exc:
            self._refusals.append(exc)
        return local

    # -- sending ---------------------------------------------------------------------
    def push(self, req_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
             layers: Sequence[int] | None = None, head_range: tuple[int, int] | None = None,
             *, peer: str | None = None) -> TransferHandle:
        peer_id = self._pick_peer(peer)
        remote = self._peers[peer_id]
        plan = make_plan(req_id, src_block_ids, dst_block_ids, layers, head_range,
                         self.descriptor().spec, self._num_blocks, remote.spec,
                         remote.num_blocks)
        handle = TransferHandle(req_id, nbytes=plan.nbytes(remote.spec),
                                num_blocks=plan.num_blocks)
        return self._enqueue(_Job(peer=peer_id, handle=handle, plan=plan))

    def send_done(self, req_id: str, payload: bytes, *, peer: str | None = None
                  ) -> TransferHandle:
        handle = TransferHandle(req_id)
        return self._enqueue(_Job(peer=self._pick_peer(peer), handle=handle,
                                  payload=bytes(payload)))

    def _pick_peer(self, peer: str | None) -> str:
        if peer is not None:
            if peer not in self._peers:
                raise KVTransferError(f"not connected to {peer!r}")
            return peer
        if len(self._peers) != 1:
            raise KVTransferError(f"name the peer: {len(self._peers)} are connected")
        return next(iter(self._peers))

    def _enqueue(self, job: _Job) -> TransferHandle:
        self._jobs.append(job)
        if self._auto:
            while self._jobs:
                self.progress()
        return job.handle

    def pending(self) -> int:
        return len(self._jobs)

    def progress(self) -> None:
        """Advance every queued job one step, in queue order."""
        for job in list(self._jobs):
            if job.handle.poll() is TransferState.PENDING:
                self._start(job)
            else:
                self._complete(job)
            if job.handle.done:
                self._jobs.remove(job)

    def _start(self, job: _Job) -> None:
        job.handle._start()
        if job.plan is None:
            return
        spec = self.descriptor().spec
        job.staging = torch.empty(staging_shape(job.plan, spec), dtype=spec.torch_dtype,
                                  device=self._k[0].device)
        gather(job.plan, self._k, self._v, job.staging)

    def _complete(self, job: _Job) -> None:
        node = self._fabric.lookup(job.peer)
        if node is None:
            self._fail(job, f"peer {job.peer!r} is unavailable")
            return
        try:
            if job.plan is None:
                node._dones.deliver(job.handle.req_id, job.payload)
            else:
                node._place(job.plan, job.staging)
        except ValueError as exc:
            self._fail(job, f"peer {job.peer!r} rejected the push: {exc}")
            return
        if job.handle._finish(TransferState.SUCCESS) and job.plan is not None:
            self._sent.record_success(job.handle.nbytes, job.handle.num_blocks,
                                      time.monotonic() - job.handle.created_at)

    def _fail(self, job: _Job, error: str) -> None:
        if job.handle._finish(TransferState.FAILED, error):
            self._sent.record_failure()

    # -- receiving -------------------------------------------------------------------
    def _place(self, plan: TransferPlan, staging: torch.Tensor) -> None:
        """Receiver side: re-validate the plan against our own cache, then scatter."""
        start = time.monotonic()
        spec = self.descriptor().spec
        check_block_ids(plan.dst_block_ids, self._num_blocks, "dst", unique=True)
        check_layers(plan.layers, spec.num_layers)
        held = spec.local_heads
        if not held[0] <= plan.overlap.heads[0] < plan.overlap.heads[1] <= held[1]:
            raise ValueError(f"heads {plan.overlap.heads} not held here ({held})")

        def write() -> None:
            scatter(staging.to(self._k[0].device), plan.dst_block_ids, plan.layers,
                    plan.overlap.dst, self._k, self._v)

        if self._permits is None:
            write()
        elif not self._permits.place(plan.req_id, plan.dst_block_ids, write):
            return  # the request holds no permit for these blocks here: dropped
        self._received.record_success(plan.nbytes(spec), plan.num_blocks,
                                      time.monotonic() - start)

    def guard_writes(self, permits: WritePermits) -> None:
        self._permits = permits

    def poll_done(self) -> list[tuple[str, bytes]]:
        return self._dones.poll()

    def set_done_callback(self, callback: DoneCallback | None) -> None:
        self._dones.set_callback(callback)

    # -- observability / teardown ----------------------------------------------------
    def stats(self) -> TransferStats:
        return self._sent.snapshot()

    def recv_stats(self) -> TransferStats:
        return self._received.snapshot()

    def handshake_refusals(self) -> list[FingerprintMismatch]:
        return list(self._refusals)

    def close(self) -> None:
        self._fabric.kill(self.address)
        for job in list(self._jobs):
            self._fail(job, "transport closed")
        self._jobs.clear()

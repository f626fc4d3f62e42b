"""UCX KV transport (ucxx): host caches moved between processes and machines.

Wiring. No connection listener: peers connect to UCX worker addresses, so the only socket
is UCX's TCP transport's, on config.host and the runtime's port (ucx_runtime.py, netdev.py).
`register` posts a receive on the transport's own HELLO tag (the descriptor carries the
worker address and that tag). `connect` opens an endpoint to the peer's worker address and
sends HELLO there (descriptor + its own worker address + the two tags of the connection +
the auth token when one is configured); the peer opens an endpoint back to that address and
answers on it, and from then on each side sends on one tag and receives on the other
(TaggedEndpoint). A receiver with a token first refuses a HELLO without the same one
(HELLO_REPLY carrying only the refusal: no descriptor, no worker address); then both
sides check the fingerprint: the receiver answers HELLO_REPLY and records any refusal,
the connector raises FingerprintMismatch. With `fast_data_path` (opt-in: it does not survive
a peer's death, KVTransferConfig says why) the connector also opens a data endpoint without
error handling to the receiver's worker address (shared memory on one host).

One push on the wire (sender: ucx_conn.py, receiver: ucx_inbound.py):

    DATA header ─▶ receiver validates dst blocks / layers / heads and the byte count
    layer chunks ─▶ received into one reusable staging buffer; each chunk is scattered
                    into the dst blocks as it lands, while later chunks are in flight
    ACK(seq) ◀── receiver; the sender's handle becomes SUCCESS

A DONE message is handled only after every earlier message on its connection, so the
receiver's `poll_done()` / callback sees a request complete after its bytes landed.
Integrity (pdserve/kv_transfer/integrity.py): a receiver with `checksums` says so in HELLO_REPLY; its
senders then follow each push's data with a SEAL of their digests, and a push that does not
match fails, its request's done message replaced by `INTEGRITY_REFUSAL`.
With `guard_writes(permits)` each chunk is scattered only under the request's permit;
a push whose request holds none is drained, acknowledged and dropped.

Everything network-facing runs on the process's UCX loop thread (ucx_runtime.py); the
caller's `push`/`send_done`/`poll`/`poll_done` never wait on the network.

Must never: pickle, write a block the header did not name, or wait without a timeout
on anything but an idle connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .base import (FingerprintMismatch, KVCacheSpec, KVDescriptor, KVTransferError,
                   KVTransport, TransferHandle, TransferState, WritePermits)
from .config import KVTransferConfig
from .integrity import check_payload, make_sealer
from .ledger import LedgerReads, TransferLedger
from .layout import make_plan, validate_caches
from .ucx_conn import Connection, Job, header_nbytes
from .ucx_hello import hello_body, hello_msg, parse_hello, random_tag, way_back
from .ucx_inbound import Inbound, ReceiverSide
from .ucx_runtime import TaggedEndpoint, UcxRuntime, abort_endpoint, recv_ctrl, send_ctrl
from .wire import STATUS_ERROR, STATUS_OK, ControlMsg, MsgKind, WireError

logger = logging.getLogger(__name__)


class UcxTransport(LedgerReads, KVTransport):
    def __init__(self, config: KVTransferConfig | None = None) -> None:
        self.config = config or KVTransferConfig()
        self._rt = UcxRuntime.get(self.config)
        self.ledger = TransferLedger()  # counters, done messages, refusals
        self._spec: KVCacheSpec | None = None
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._num_blocks = 0
        self._hello_tag = random_tag()  # names this transport on the process's worker
        self._accepting: asyncio.Task | None = None
        self._conns: dict[str, Connection] = {}
        self._inbound: set[Any] = set()
        self._serving: set[asyncio.Task] = set()
        self._watchdog: asyncio.Future | None = None
        self._permits: WritePermits | None = None  # None: every valid push is placed
        self._quarantine: list[torch.Tensor] = []  # staging buffers of failed receives
        self._sealer = make_sealer(self.config.debug_corrupt_push)  # loop thread only
        self._closed = False

    # -- setup -----------------------------------------------------------------------
    def register(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
                 spec: KVCacheSpec) -> KVDescriptor:
        if any(cache.device.type != "cpu" for cache in [*k_caches, *v_caches]):
            raise ValueError("UcxTransport moves host caches; got a non-CPU tensor")
        self._num_blocks = validate_caches(k_caches, v_caches, spec)
        self._k, self._v, self._spec = list(k_caches), list(v_caches), spec
        self._rt.call(self._listen(), self.config.connect_timeout_s)
        return self.descriptor()

    def descriptor(self) -> KVDescriptor:
        if self._spec is None:
            raise KVTransferError("register() the caches first")
        return KVDescriptor(transport="ucx", address=self.config.host, port=self._rt.port,
                            num_blocks=self._num_blocks, spec=self._spec,
                            worker_address=self._worker_address(), hello_tag=self._hello_tag)

    async def _listen(self) -> None:
        self._accepting = asyncio.ensure_future(self._accept())
        self._watchdog = asyncio.ensure_future(self._watch())

    def connect(self, remote: KVDescriptor) -> str:
        return self._rt.call(self._connect(remote), self.config.connect_budget_s())

    async def _connect(self, remote: KVDescriptor) -> str:
        local = self.descriptor()
        peer_id = remote.name
        if remote.transport != "ucx" or not remote.worker_address:
            raise KVTransferError(f"KV peer {peer_id} gives no UCX worker address")
        try:
            raw = await self._endpoint_to(remote.worker_address, error_handling=True)
        except Exception as exc:
            raise KVTransferError(f"cannot reach KV peer {peer_id}: {exc!r}") from exc
        ep = TaggedEndpoint(raw, send_tag=random_tag(), recv_tag=random_tag())
        try:
            theirs, data_ep, checksums = await self._handshake(ep, local, remote, peer_id)
        except BaseException:
            abort_endpoint(ep, self.config.close_timeout_s)
            raise
        conn = Connection(peer_id, theirs, ep, data_ep, self.config, local.spec,
                          (self._k, self._v), self._finish, self._sealer if checksums else None)
        old = self._conns.get(peer_id)
        if old is not None:
            await old.close(f"replaced by a new connection to {peer_id}")
        self._conns[peer_id] = conn
        conn.start()
        return peer_id

    async def _handshake(self, ep: TaggedEndpoint, local: KVDescriptor, remote: KVDescriptor,
                         peer_id: str) -> tuple[KVDescriptor, Any, bool]:
        """(their descriptor, the data endpoint or None, whether they asked for checksums)."""
        hello = hello_msg(MsgKind.HELLO, local, local.worker_address, self.config.fast_data_path,
                          self.config.auth_token, tags=(ep.send_tag, ep.recv_tag))
        # The first message goes to the peer's HELLO tag; the rest of the connection on ours.
        first = TaggedEndpoint(ep.ep, send_tag=remote.hello_tag, recv_tag=ep.recv_tag)
        await asyncio.wait_for(send_ctrl(first, hello), self.config.handshake_timeout_s)
        buf = np.empty(self.config.max_control_bytes, dtype=np.uint8)
        reply = await asyncio.wait_for(recv_ctrl(ep, buf), self.config.handshake_timeout_s)
        if reply.kind is not MsgKind.HELLO_REPLY:
            raise KVTransferError(f"peer {peer_id} answered {reply.kind.name}, not HELLO_REPLY")
        body = hello_body(reply)
        refusal = body.get("refused")
        if refusal is not None:
            raise KVTransferError(f"peer {peer_id} refused the connection: {refusal}")
        theirs, worker_address, _ = parse_hello(reply)
        local.spec.check_compatible(theirs.spec.fingerprint(), f"peer {peer_id}")
        if reply.status != STATUS_OK:
            raise KVTransferError(f"peer {peer_id} refused the connection")
        checksums = body.get("checksums") is True
        if not worker_address:  # either side wants data on the control endpoint
            return theirs, None, checksums
        data_ep = await self._endpoint_to(worker_address, error_handling=False)
        return theirs, data_ep, checksums

    async def _endpoint_to(self, worker_address: str, *, error_handling: bool) -> Any:
        """An endpoint to a peer's worker (error handling: the peer's failure cancels what
        waits on it, which UCX supports only on lanes that can tell: no shared memory;
        without it, a failure UCX cannot hand to the endpoint aborts the process)."""
        address = self._rt.ucxx.get_ucx_address_from_buffer(bytes.fromhex(worker_address))
        return await asyncio.wait_for(
            self._rt.ucxx.create_endpoint_from_worker_address(
                address, endpoint_error_handling=error_handling), self.config.connect_timeout_s)

    def _worker_address(self) -> str:
        return self._rt.ucxx.get_worker_address().tobytes().hex()

    # -- sending (caller's thread: validate, hand over, return) ----------------------
    def push(self, req_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
             layers: Sequence[int] | None = None, head_range: tuple[int, int] | None = None,
             *, peer: str | None = None) -> TransferHandle:
        conn = self._pick(peer)
        plan = make_plan(req_id, src_block_ids, dst_block_ids, layers, head_range,
                         self.descriptor().spec, self._num_blocks, conn.remote.spec,
                         conn.remote.num_blocks)
        self._check_control_size(header_nbytes(req_id, plan.num_blocks, len(plan.layers)))
        handle = TransferHandle(req_id, nbytes=plan.nbytes(self.descriptor().spec),
                                num_blocks=plan.num_blocks)
        self._rt.call_soon(conn.enqueue, Job(handle=handle, plan=plan))
        return handle

    def send_done(self, req_id: str, payload: bytes, *, peer: str | None = None
                  ) -> TransferHandle:
        conn = self._pick(peer)
        check_payload(payload)
        self._check_control_size(header_nbytes(req_id, 0, 0, len(payload)))
        handle = TransferHandle(req_id)
        self._rt.call_soon(conn.enqueue, Job(handle=handle, payload=bytes(payload)))
        return handle

    def _pick(self, peer: str | None) -> Connection:
        if self._closed:
            raise KVTransferError("transport is closed")
        if peer is not None:
            if peer not in self._conns:
                raise KVTransferError(f"not connected to {peer!r}")
            return self._conns[peer]
        if len(self._conns) != 1:
            raise KVTransferError(f"name the peer: {len(self._conns)} are connected")
        return next(iter(self._conns.values()))

    def _check_control_size(self, nbytes: int) -> None:
        if nbytes > self.config.max_control_bytes:
            raise ValueError(f"control message of {nbytes} bytes exceeds "
                             f"max_control_bytes={self.config.max_control_bytes}")

    def _finish(self, job: Job, error: str | None) -> None:
        """Loop thread: make a job terminal and count it (pushes only)."""
        state = TransferState.FAILED if error else TransferState.SUCCESS
        if job.handle.done:  # the first terminal state wins (only this loop thread ends handles)
            return
        if job.plan is not None:  # counted first: whoever sees the handle end sees its bytes counted
            self.ledger.count_sent(error is None, job.handle.nbytes, job.handle.num_blocks,
                                   time.monotonic() - job.handle.created_at)
        job.handle._finish(state, error)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.watchdog_interval_s)
            now = time.monotonic()
            for conn in list(self._conns.values()):
                conn.check_deadlines(now)

    # -- receiving (loop thread) -----------------------------------------------------
    async def _accept(self) -> None:
        """Every HELLO sent to this transport's tag starts one inbound connection. The
        receive stays posted until a message comes (close() sends the last one), so its
        buffer lives as long as this loop."""
        buf = np.empty(self.config.max_control_bytes, dtype=np.uint8)
        while True:
            await self._rt.ucxx.recv(buf, tag=self._hello_tag)
            if self._closed:
                return
            try:
                hello = ControlMsg.decode(buf.data)  # a copy: the buffer is reposted
            except WireError as exc:
                logger.info("ignored a malformed KV HELLO: %s", exc)
                continue
            task = asyncio.ensure_future(self._serve(hello))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, hello: ControlMsg) -> None:
        """One inbound connection, from HELLO until it drops."""
        try:
            ep = await self._reply_endpoint(hello)
        except Exception as exc:  # no way to answer: nothing to refuse on
            logger.info("ignored a KV HELLO that gives no way back: %r", exc)
            return
        self._inbound.add(ep)
        buf = np.empty(self.config.max_control_bytes, dtype=np.uint8)
        mirror = None
        try:
            accepted, data_on_worker = await self._answer_hello(ep, hello)
            if not accepted:
                await self._drain_until_closed(ep, buf)
                return
            if data_on_worker:
                mirror = await self._mirror_data_endpoint(hello)
            await Inbound(self._receiver_side(data_on_worker), ep).run(buf)
        except Exception as exc:  # peer gone or protocol error: drop the connection
            logger.info("inbound KV connection ended: %r", exc)
        finally:
            self._inbound.discard(ep)
            abort_endpoint(mirror, self.config.close_timeout_s)
            abort_endpoint(ep, self.config.close_timeout_s)

    async def _mirror_data_endpoint(self, hello: ControlMsg) -> Any:
        """An unused endpoint matching the connector's data endpoint. UCX pairs the endpoints
        two workers open to each other by their order and refuses a pair whose error handling
        differs, so each side opens the same ones in the same order: control (error handling),
        then data (none). Without this one, the next connection's control endpoint would be
        paired with this connection's data endpoint and refused. (This holds because two
        workers connect one way only: a prefill rank to a decode rank.)"""
        address, _ = way_back(hello)
        return await self._endpoint_to(address, error_handling=False)

    async def _reply_endpoint(self, hello: ControlMsg) -> TaggedEndpoint:
        """An endpoint back to the connector's worker, on the tags its HELLO chose."""
        address, (theirs_to_us, ours_to_them) = way_back(hello)
        raw = await self._endpoint_to(address, error_handling=True)
        return TaggedEndpoint(raw, send_tag=ours_to_them, recv_tag=theirs_to_us)

    async def _answer_hello(self, ep: Any, hello: ControlMsg) -> tuple[bool, bool]:
        """Reply to HELLO; returns (accepted, data arrives on the worker by tag)."""
        if hello.kind is not MsgKind.HELLO:
            raise WireError(f"expected HELLO, got {hello.kind.name}")
        if not self.config.admits(hello_body(hello).get("auth_token")):
            await self._refuse_unauthenticated(ep)
            return False, False
        theirs, _, their_fast = parse_hello(hello)
        local = self.descriptor()
        # Both ends must want the fast path; the reply's worker address says it is on.
        data_on_worker = their_fast and self.config.fast_data_path
        reply = hello_msg(MsgKind.HELLO_REPLY, local,
                          self._worker_address() if data_on_worker else "", data_on_worker,
                          checksums=self.config.checksums)
        try:
            local.spec.check_compatible(theirs.spec.fingerprint(),
                                        f"refused peer {theirs.name}")
        except FingerprintMismatch as exc:
            logger.error("%s", exc)
            self.ledger.refused(exc)
            reply.status = STATUS_ERROR
        await asyncio.wait_for(send_ctrl(ep, reply), self.config.handshake_timeout_s)
        return reply.status == STATUS_OK, data_on_worker

    async def _refuse_unauthenticated(self, ep: Any) -> None:
        # Nothing about this side (descriptor, worker address) goes to an unauthenticated peer.
        logger.warning("refused a KV peer: missing or wrong auth token")
        body = {"refused": "authentication failed: missing or wrong auth token"}
        reply = ControlMsg(MsgKind.HELLO_REPLY, status=STATUS_ERROR, extra=json.dumps(body).encode())
        await asyncio.wait_for(send_ctrl(ep, reply), self.config.handshake_timeout_s)

    async def _drain_until_closed(self, ep: Any, buf: np.ndarray) -> None:
        """After a refusal, let the connector read the reply and hang up first."""
        try:
            await asyncio.wait_for(ep.recv(buf), self.config.handshake_timeout_s)
        except Exception:
            return

    def _receiver_side(self, data_on_worker: bool) -> ReceiverSide:
        return ReceiverSide(
            spec=self.descriptor().spec, k_caches=self._k, v_caches=self._v,
            num_blocks=self._num_blocks, config=self.config,
            worker_recv=self._rt.ucxx.recv if data_on_worker else None,
            deliver_done=self.ledger.dones.deliver, count=self.ledger.count_received,
            quarantine=self._quarantine, place=self._place, verify=self.config.checksums,
            count_checksum_failure=self.ledger.count_checksum_failure)

    def guard_writes(self, permits: WritePermits) -> None:
        self._permits = permits

    def _place(self, req_id: str, dst_block_ids: Sequence[int], write: Callable[[], None]) -> bool:
        """Loop thread: write a chunk of a push if its request may (read per call: the
        permits may be installed after a connection was accepted)."""
        permits = self._permits
        if permits is None:
            write()
            return True
        return permits.place(req_id, dst_block_ids, write)

    # -- observability / teardown ----------------------------------------------------
    def peers(self) -> list[str]:
        return list(self._conns)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._rt.call(self._close(), self.config.close_timeout_s * 2)
        except TimeoutError:
            logger.warning("UcxTransport.close() timed out")

    async def _close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for conn in list(self._conns.values()):
            await conn.close("transport closed")
        for task in list(self._serving):
            task.cancel()
        for ep in list(self._inbound):
            abort_endpoint(ep, self.config.close_timeout_s)
        if self._accepting is not None:
            await self._stop_accepting(self._accepting)

    async def _stop_accepting(self, accepting: asyncio.Task) -> None:
        """Complete the posted HELLO receive with a message to ourselves (cancelling the
        task would leave UCX a receive into a buffer nobody holds)."""
        try:
            ep = await self._endpoint_to(self._worker_address(), error_handling=False)
            await asyncio.wait_for(ep.send(np.zeros(1, dtype=np.uint8), tag=self._hello_tag,
                                           force_tag=True), self.config.close_timeout_s)
            await asyncio.wait_for(accepting, self.config.close_timeout_s)
            abort_endpoint(ep, self.config.close_timeout_s)
        except Exception as exc:  # the receive stays posted; its buffer stays with the task
            logger.warning("KV HELLO receive not stopped: %r", exc)

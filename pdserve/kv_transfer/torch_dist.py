"""torch.distributed KV transport: caches moved over one two-rank process group per rank pair.

Wiring. `register` starts a TCPStore server on config.host:port (the descriptor carries the
real port, and `transport="torch"`, so the decode node's layout says which transport it takes).
`connect` dials that store and claims the next free pair number by setting its HELLO there in
one atomic step (`compare_set` on `hello/<n>`: descriptor, the caches' device, the auth token
when one is configured, a nonce), so no number is ever taken without its HELLO; then it waits
for the HELLO_REPLY under the same number. The listener's accept thread answers each HELLO in turn: a
wrong token is refused first (the reply names nothing of this side), then both sides check the
fingerprint, and the transports must be the same (`transport` is named as a differing field).
Once accepted, both build the pair's groups under its own prefix of the store
(pdserve/kv_transfer/torch_pair.py: gloo for control and host caches, NCCL for CUDA caches on two GPUs).

Bounds. Reaching a store waits at most store_timeout_s, the HELLO_REPLY and joining the pair's
groups each at most rendezvous_timeout_s, so a peer that never comes (or dies between the steps)
fails `connect` with a KVTransferError naming it and the step, which the node's transfer failure
path handles like any other. The store serves a socket bound to --kv-host:--kv-port (only that
address) and listening before `register` returns, so its advertised port is there to dial. A connector that dies after its HELLO holds up nobody: the accept loop
answers it and the pair's join on this side fails after rendezvous_timeout_s, on its own thread.

Integrity (pdserve/kv_transfer/integrity.py): a receiver with `checksums` says so in its HELLO_REPLY;
its senders then digest each push's staging bytes before they leave and follow them with a SEAL
(the digest), which the receiver compares before placing anything.

One push: the sender's thread gathers, sends the DATA header and the bytes and waits for the ACK
(pdserve/kv_transfer/torch_conn.py); the receiver's thread validates, receives, places under the write
permits and acks (pdserve/kv_transfer/torch_inbound.py). A DONE is handled after every earlier message
of its pair. Counters, refusals, permits and the done callback mean what they mean on UCX.

Must never: join the process's default group, pickle, or block the caller of `push`.
"""

from __future__ import annotations

import datetime
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .base import (FingerprintMismatch, KVCacheSpec, KVDescriptor, KVTransferError, KVTransport, TransferHandle,
                   TransferState, WritePermits)
from .config import KVTransferConfig
from .integrity import check_payload, make_sealer
from .ledger import LedgerReads, TransferLedger
from .layout import make_plan, validate_caches
from .torch_conn import TorchConnection
from .torch_inbound import TorchInbound
from .torch_pair import (ANSWERED, CLOSE, IDLE_TIMEOUT, RECEIVER_RANK, SENDER_RANK, PairGroup, claim_hello,
                         close_key, data_backend, device_id)
from .ucx_conn import Job, header_nbytes
from .ucx_inbound import ReceiverSide

logger = logging.getLogger(__name__)

TRANSPORT_NAME = "torch"


class TorchTransport(LedgerReads, KVTransport):
    def __init__(self, config: KVTransferConfig | None = None) -> None:
        self.config = config or KVTransferConfig()
        self._lock = threading.Lock()  # connections, threads, the handle's first terminal state
        self.ledger = TransferLedger()  # counters, done messages, refusals
        self._spec: KVCacheSpec | None = None
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._device = torch.device("cpu")
        self._num_blocks = 0
        self._store: dist.TCPStore | None = None
        self._conns: dict[str, TorchConnection] = {}
        self._inbound: dict[int, TorchInbound] = {}
        # The threads `close` waits for, so none is left inside a torch call when the process exits
        # (one that returns into a finalizing interpreter aborts it): the accept loop, each inbound pair.
        self._threads: list[threading.Thread] = []
        self._accepting = 1  # the pair number whose HELLO the accept loop waits for
        self._permits: WritePermits | None = None  # None: every valid push is placed
        self._sealer = make_sealer(self.config.debug_corrupt_push)  # shared by every connection's thread
        self._closed = threading.Event()

    # -- setup -------------------------------------------------------------------------
    def register(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
                 spec: KVCacheSpec) -> KVDescriptor:
        devices = {cache.device for cache in [*k_caches, *v_caches]}
        if len(devices) != 1:
            raise ValueError(f"TorchTransport moves caches on one device; got {sorted(map(str, devices))}")
        self._num_blocks = validate_caches(k_caches, v_caches, spec)
        self._k, self._v, self._spec, (self._device,) = list(k_caches), list(v_caches), spec, devices
        self._store = self._serve_store()
        accept_store = self._own_client()
        self._start(threading.Thread(target=self._accept_loop, args=(accept_store,), name="kv-accept", daemon=True))
        threading.Thread(target=self._watch, name="kv-watchdog", daemon=True).start()
        return self.descriptor()

    def _own_client(self) -> dist.TCPStore:
        """A client of this rank's store for one waiting thread (a client runs one call at a time)."""
        return self._dial(self.config.host, self._store.port, "this rank's own")

    def _serve_store(self) -> dist.TCPStore:
        """This rank's store, served on a socket this side bound to --kv-host:--kv-port and handed
        over listening (the store's own bind would take every interface), so the port the
        descriptor advertises is already served when it is read."""
        host, port = self.config.host, self.config.port
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            listener = socket.create_server((host, port), family=family)
        except OSError as exc:
            raise KVTransferError(f"cannot listen on {host}:{port} (--kv-host, --kv-port): {exc}") from exc
        bound = listener.getsockname()[1]
        return self._dial(host, bound, "this rank's own", listen_fd=listener.detach())  # the store owns it now

    def _dial(self, host: str, port: int, whose: str, listen_fd: int | None = None) -> dist.TCPStore:
        """A store client (and the store's server on `listen_fd`, when given), connected within
        store_timeout_s: the store retries its connect until then, a bound long enough to outlast a
        dropped reverse DNS query (see KVTransferConfig.store_timeout_s)."""
        timeout = self.config.store_timeout_s
        try:
            return dist.TCPStore(host, port, is_master=listen_fd is not None, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=timeout), master_listen_fd=listen_fd)
        except Exception as exc:
            raise KVTransferError(f"cannot reach {whose} KV store at {host}:{port} within {timeout:.0f}s "
                                  f"(store_timeout_s): {exc!r}") from exc

    def descriptor(self) -> KVDescriptor:
        if self._spec is None or self._store is None:
            raise KVTransferError("register() the caches first")
        return KVDescriptor(transport=TRANSPORT_NAME, address=self.config.host, port=self._store.port,
                            num_blocks=self._num_blocks, spec=self._spec)

    def connect(self, remote: KVDescriptor) -> str:
        local = self.descriptor()
        peer_id = f"{remote.address}:{remote.port}"
        if remote.transport != TRANSPORT_NAME:
            raise FingerprintMismatch({"transport": (TRANSPORT_NAME, remote.transport)}, f"peer {peer_id}")
        store = self._dial(remote.address, remote.port, f"peer {peer_id}'s")
        number, theirs, their_device, checksums = self._handshake(store, local, peer_id)
        pair = self._join(store, number, SENDER_RANK, data_backend(self._device, their_device,
                                                                   device_id(self._device)), peer_id)
        conn = TorchConnection(peer_id, theirs, pair, self.config, local.spec, (self._k, self._v), self._finish,
                               self._sealer if checksums else None)
        with self._lock:
            old, self._conns[peer_id] = self._conns.get(peer_id), conn
        if old is not None:
            old.close(f"replaced by a new connection to {peer_id}")
        conn.start()
        return peer_id

    def _join(self, store: dist.TCPStore, number: int, rank: int, backend: str, peer: str) -> PairGroup:
        """This rank's side of pair `number`; a KVTransferError if the peer does not join in time."""
        timeout = self.config.rendezvous_timeout_s
        try:
            return PairGroup.join(store, f"pair/{number}", rank, self.config.host, backend, self._device, timeout)
        except Exception as exc:
            raise KVTransferError(f"KV peer {peer} did not join pair {number} within {timeout:.0f}s "
                                  f"(rendezvous_timeout_s): {exc!r}") from exc

    def _handshake(self, store: dist.TCPStore, local: KVDescriptor,
                   peer_id: str) -> tuple[int, KVDescriptor, str, bool]:
        """(the pair number, their descriptor, their caches' device, whether they asked for checksums)."""
        hello = {"descriptor": json.loads(local.to_bytes()), "device": device_id(self._device),
                 "nonce": secrets.token_hex(8)}  # tells this HELLO from any other in a claimed slot
        if self.config.auth_token is not None:
            hello["auth_token"] = self.config.auth_token
        number = claim_hello(store, json.dumps(hello).encode(), peer_id)
        timeout = self.config.rendezvous_timeout_s  # the peer's store may be stalled by another's connect
        try:
            store.wait([f"reply/{number}"], datetime.timedelta(seconds=timeout))
        except Exception as exc:
            raise KVTransferError(f"peer {peer_id} did not answer the handshake within {timeout:.0f}s "
                                  f"(rendezvous_timeout_s): {exc!r}") from exc
        reply = json.loads(store.get(f"reply/{number}"))
        if "refused" in reply:
            raise KVTransferError(f"peer {peer_id} refused the connection: {reply['refused']}")
        theirs = KVDescriptor.from_bytes(json.dumps(reply["descriptor"]).encode())
        local.spec.check_compatible(theirs.spec.fingerprint(), f"peer {peer_id}")
        if not reply["accepted"]:
            raise KVTransferError(f"peer {peer_id} refused the connection")
        return number, theirs, str(reply["device"]), reply.get("checksums") is True

    # -- sending (caller's thread: validate, hand over, return) ------------------------
    def push(self, req_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
             layers: Sequence[int] | None = None, head_range: tuple[int, int] | None = None,
             *, peer: str | None = None) -> TransferHandle:
        conn = self._pick(peer)
        spec = self.descriptor().spec
        plan = make_plan(req_id, src_block_ids, dst_block_ids, layers, head_range, spec, self._num_blocks,
                         conn.remote.spec, conn.remote.num_blocks)
        self._check_control_size(header_nbytes(req_id, plan.num_blocks, len(plan.layers)))
        handle = TransferHandle(req_id, nbytes=plan.nbytes(spec), num_blocks=plan.num_blocks)
        conn.enqueue(Job(handle=handle, plan=plan))
        return handle

    def send_done(self, req_id: str, payload: bytes, *, peer: str | None = None) -> TransferHandle:
        check_payload(payload)
        conn = self._pick(peer)
        self._check_control_size(header_nbytes(req_id, 0, 0, len(payload)))
        handle = TransferHandle(req_id)
        conn.enqueue(Job(handle=handle, payload=bytes(payload)))
        return handle

    def _pick(self, peer: str | None) -> TorchConnection:
        if self._closed.is_set():
            raise KVTransferError("transport is closed")
        with self._lock:
            conns = dict(self._conns)
        if peer is not None:
            if peer not in conns:
                raise KVTransferError(f"not connected to {peer!r}")
            return conns[peer]
        if len(conns) != 1:
            raise KVTransferError(f"name the peer: {len(conns)} are connected")
        return next(iter(conns.values()))

    def _check_control_size(self, nbytes: int) -> None:
        if nbytes > self.config.max_control_bytes:
            raise ValueError(f"control message of {nbytes} bytes exceeds "
                             f"max_control_bytes={self.config.max_control_bytes}")

    def _finish(self, job: Job, error: str | None) -> None:
        """Make a job terminal and count it (pushes only); the first terminal state wins."""
        with self._lock:
            if job.handle.done:
                return
            if job.plan is not None:  # counted first: whoever sees the handle end sees its bytes counted
                self.ledger.count_sent(error is None, job.handle.nbytes, job.handle.num_blocks,
                                       time.monotonic() - job.handle.created_at)
        job.handle._finish(TransferState.FAILED if error else TransferState.SUCCESS, error)

    def _watch(self) -> None:
        while not self._closed.wait(self.config.watchdog_interval_s):
            now = time.monotonic()
            with self._lock:
                conns = list(self._conns.values())
            for conn in conns:
                conn.check_deadlines(now)

    # -- receiving ---------------------------------------------------------------------
    def _accept_loop(self, store: dist.TCPStore) -> None:
        """Answer each connector's HELLO in the order they took their numbers, until closed
        (`close` sets CLOSE as the awaited HELLO)."""
        while not self._closed.is_set():
            number = self._accepting
            key = f"hello/{number}"
            store.wait([key], IDLE_TIMEOUT)  # set by its connector's claim, or by close
            raw = store.get(key)
            if raw == CLOSE:
                return
            try:
                self._answer(number, json.loads(raw))
            except Exception as exc:  # a malformed HELLO: that connector times out, the others go on
                logger.warning("KV handshake %d failed: %r", number, exc)
            self._accepting = number + 1
            store.add(ANSWERED, 1)

    def _answer(self, number: int, hello: dict) -> None:
        if not self.config.admits(hello.get("auth_token")):
            logger.warning("refused a KV peer: missing or wrong auth token")
            self._store.set(f"reply/{number}", json.dumps({"refused": "authentication failed: missing or wrong "
                                                                      "auth token"}))
            return
        theirs = KVDescriptor.from_bytes(json.dumps(hello["descriptor"]).encode())
        local = self.descriptor()
        accepted = True
        try:
            if theirs.transport != TRANSPORT_NAME:
                raise FingerprintMismatch({"transport": (TRANSPORT_NAME, theirs.transport)},
                                          f"refused peer {theirs.address}:{theirs.port}")
            local.spec.check_compatible(theirs.spec.fingerprint(), f"refused peer {theirs.address}:{theirs.port}")
        except FingerprintMismatch as exc:
            logger.error("%s", exc)
            self.ledger.refused(exc)
            accepted = False
        own_device = device_id(self._device)
        self._store.set(f"reply/{number}", json.dumps({"descriptor": json.loads(local.to_bytes()),
                                                       "device": own_device, "accepted": accepted,
                                                       "checksums": self.config.checksums}))
        if not accepted:
            return
        backend = data_backend(self._device, str(hello["device"]), own_device)
        self._start(threading.Thread(target=self._serve_pair, args=(number, backend, f"{theirs.address}:{theirs.port}"),
                                     name=f"kv-recv-{number}", daemon=True))

    def _start(self, thread: threading.Thread) -> None:
        with self._lock:  # not once closing began: `close` would not wait for it
            if self._closed.is_set():
                return
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _serve_pair(self, number: int, backend: str, peer: str) -> None:
        try:
            pair = self._join(self._own_client(), number, RECEIVER_RANK, backend, peer)
        except KVTransferError as exc:  # the sender's connect fails on its side too: nothing was placed
            logger.warning("%s", exc)
            return
        inbound = TorchInbound(self._receiver_side(), pair, peer)
        with self._lock:
            self._inbound[number] = inbound
        if self._closed.is_set():
            inbound.close(self._store)
        try:
            inbound.run()
        finally:
            with self._lock:
                self._inbound.pop(number, None)

    def _receiver_side(self) -> ReceiverSide:
        return ReceiverSide(spec=self.descriptor().spec, k_caches=self._k, v_caches=self._v,
                            num_blocks=self._num_blocks, config=self.config, worker_recv=None,
                            deliver_done=self.ledger.dones.deliver, count=self.ledger.count_received, quarantine=[],
                            place=self._place, verify=self.config.checksums,
                            count_checksum_failure=self.ledger.count_checksum_failure)

    def guard_writes(self, permits: WritePermits) -> None:
        self._permits = permits

    def _place(self, req_id: str, dst_block_ids: Sequence[int], write: Callable[[], None]) -> bool:
        permits = self._permits  # read per call: installed after a pair may have been accepted
        if permits is None:
            write()
            return True
        return permits.place(req_id, dst_block_ids, write)

    # -- observability / teardown ------------------------------------------------------
    def peers(self) -> list[str]:
        with self._lock:
            return list(self._conns)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            conns, inbound, threads = list(self._conns.values()), list(self._inbound.values()), list(self._threads)
        for conn in conns:
            conn.close("transport closed")
        for receiver in inbound:
            receiver.close(self._store)
        if self._store is not None:
            close_key(self._store, f"hello/{self._accepting}")
        # The woken ones end at once; a pair still dialing or joining cannot be woken, and ends in time.
        cfg = self.config
        deadline = time.monotonic() + cfg.store_timeout_s + cfg.rendezvous_timeout_s + cfg.close_timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


"""One prefill/decode rank pair: its two-rank torch.distributed group and its control channel.

A pair is made on demand, once the handshake on the receiver's TCPStore has accepted it
(pdserve/kv_transfer/torch_dist.py). Both ranks build their side of a gloo group on the store under the
pair's own prefix (rank 0 the receiver, rank 1 the sender), never the process's default group,
so a process holds as many pairs as it has peers and nothing else in it sees them.

    control   the store itself, under the pair's prefix: message seq at `<prefix>/msg/<seq>`,
              its ack at `<prefix>/ack/<seq>`, the SEAL of a push (its digest, when the
              receiver asked for checksums) at `<prefix>/seal/<seq>`, each deleted once read. A store wait ends when
              its key is set, so an idle receiver waits there, and closing wakes it by setting
              the next message key itself (`CLOSE`): gloo's own receives cannot be woken
              (abort and shutdown leave them waiting), and a timed-out one breaks the pair.
    data      the staging buffer of a push, on the gloo group for host caches; on a second,
              NCCL group for CUDA caches on two different GPUs; through a host copy over gloo
              for CUDA caches on one GPU (NCCL refuses two ranks on one device). A data receive
              is posted only after its header; a data send or receive waits at most
              transfer_timeout_s.

Joining a pair's groups waits at most rendezvous_timeout_s for the peer (gloo's and NCCL's own
timeout): a peer that dies between the handshake and joining fails the join, never hangs it.

Every thread that waits on the store has its own client of it: a client runs one operation at
a time, so a waiting thread would stall every other on a shared one.

Must never: join the process's default group, pickle, or wait on gloo while idle.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .base import KVTransferError
from .wire import ControlMsg

DATA_TAG = 1
ANSWERED = "answered"  # how many HELLO numbers the listener is done with: where connectors start
CLOSE = b"close"  # a control key's value that ends the receiver's loop
RECEIVER_RANK, SENDER_RANK = 0, 1
# How long an idle receiver waits for its next message: a pair lives as long as both nodes, and
# closing wakes the wait (CLOSE). Never a rendezvous or a transfer's wait: those are bounded by
# rendezvous_timeout_s and transfer_timeout_s.
IDLE_TIMEOUT = datetime.timedelta(days=7)


def data_backend(device: torch.device, peer_device_id: str, own_device_id: str) -> str:
    """How a pair moves a push's bytes: "gloo" (host caches), "nccl" (CUDA caches on two GPUs)
    or "gloo-host-copy" (CUDA caches that share one GPU)."""
    if device.type == "cpu":
        return "gloo"
    return "gloo-host-copy" if peer_device_id == own_device_id else "nccl"


def device_id(device: torch.device) -> str:
    """Which physical device the caches are on, as the peer can compare it ("cpu" for the host)."""
    if device.type != "cuda":
        return "cpu"
    return str(torch.cuda.get_device_properties(device).uuid)


@dataclass
class PairGroup:
    store: dist.Store  # this side's own client of the receiver's store: the control channel
    prefix: str
    gloo: dist.ProcessGroup
    data: dist.ProcessGroup  # `gloo` itself unless the data rides NCCL
    backend: str  # data_backend's answer
    rank: int
    device: torch.device

    @property
    def peer(self) -> int:
        return 1 - self.rank

    @classmethod
    def join(cls, store: dist.Store, prefix: str, rank: int, host: str, backend: str,
             device: torch.device, timeout_s: float) -> PairGroup:
        """Build this rank's side, waiting at most `timeout_s` for the peer to build its own
        (raises past it); `host`: the address this rank's side listens on for the pair's sockets."""
        timeout = datetime.timedelta(seconds=timeout_s)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timeout
        gloo = dist.ProcessGroupGloo(dist.PrefixStore(prefix + "/gloo", store), rank, 2, options)
        data = gloo
        if backend == "nccl":  # NCCL meets its peer on the first send/receive, within `timeout`
            nccl_options = dist.ProcessGroupNCCL.Options()
            nccl_options._timeout = timeout
            data = dist.ProcessGroupNCCL(dist.PrefixStore(prefix + "/nccl", store), rank, 2, nccl_options)
        return cls(store, prefix, gloo, data, backend, rank, device)

    # -- control ---------------------------------------------------------------------
    def send_ctrl(self, seq: int, msg: ControlMsg | None, ack: bool = False) -> None:
        """Message `seq` to the peer (an ack of its message `seq` when `ack`); None: CLOSE."""
        raw = CLOSE if msg is None else msg.encode()
        self.store.set(self._key(seq, ack), raw)

    def close_receiver(self, closer: dist.Store, seq: int) -> None:
        """Wake this receiver's wait for message `seq` with CLOSE, unless the sender set it first."""
        close_key(closer, self.prefix + f"/msg/{seq}")

    def recv_ctrl(self, seq: int, timeout_s: float | None = None, ack: bool = False) -> ControlMsg | None:
        """Message `seq` from the peer (its ack of our `seq` when `ack`), at most `timeout_s`
        away (None: until it comes or the pair closes); None: CLOSE."""
        raw = self._take(self._key(seq, ack), IDLE_TIMEOUT if timeout_s is None else _delta(timeout_s))
        return None if raw == CLOSE else ControlMsg.decode(raw)

    def send_seal(self, seq: int, digests: bytes) -> None:
        """The SEAL of push `seq`: its digests (pdserve/kv_transfer/integrity.py), set after its bytes."""
        self.store.set(f"{self.prefix}/seal/{seq}", digests)

    def recv_seal(self, seq: int, timeout_s: float) -> bytes:
        return self._take(f"{self.prefix}/seal/{seq}", _delta(timeout_s))

    def _take(self, key: str, timeout: datetime.timedelta) -> bytes:
        self.store.wait([key], timeout)
        raw = self.store.get(key)
        self.store.delete_key(key)
        return raw

    def _key(self, seq: int, ack: bool) -> str:
        return f"{self.prefix}/{'ack' if ack else 'msg'}/{seq}"

    # -- data --------------------------------------------------------------------------
    def send_data(self, staging: torch.Tensor, timeout_s: float) -> None:
        """Send a flat uint8 staging buffer; it may be reused once this returns."""
        wire = staging.cpu() if self.backend == "gloo-host-copy" else staging
        _wait(self.data.send([wire], self.peer, DATA_TAG), timeout_s)
        finish_device_work(self.device)

    def recv_data(self, staging: torch.Tensor, timeout_s: float) -> None:
        """Fill a flat uint8 staging buffer with the peer's next push."""
        if self.backend == "gloo-host-copy":
            host = torch.empty(staging.shape, dtype=torch.uint8)
            _wait(self.data.recv([host], self.peer, DATA_TAG), timeout_s)
            staging.copy_(host)
        else:
            _wait(self.data.recv([staging], self.peer, DATA_TAG), timeout_s)
        finish_device_work(self.device)

    def abort(self) -> None:
        """End the pair's groups: their sockets close, so the peer's next data operation fails."""
        for group in {id(self.gloo): self.gloo, id(self.data): self.data}.values():
            try:
                group.abort()
            except Exception:  # already broken or shut down: nothing left to end
                pass


def claim_hello(store: dist.TCPStore, hello: bytes, peer_id: str) -> int:
    """Set `hello` under the first free pair number from the listener's next one; that number.

    `compare_set` claims a number and publishes its HELLO in one step. The `set` after it (of the
    value the key holds, whoever's) wakes the listener where compare_set does not on every store
    backend, also for a number whose claimant died between the two calls."""
    number = store.add(ANSWERED, 0) + 1
    while True:
        key = f"hello/{number}"
        held = store.compare_set(key, "", hello)
        store.set(key, held)
        if held == hello:
            return number
        if held == CLOSE:
            raise KVTransferError(f"peer {peer_id} is closing")
        number += 1


def close_key(closer: dist.Store, key: str) -> None:
    """Set `key` to CLOSE unless it holds a message already, waking whoever waits for it."""
    if closer.compare_set(key, "", CLOSE) == CLOSE:
        closer.set(key, CLOSE)  # compare_set stores it but does not wake a waiting client; set does


def _wait(work, timeout_s: float) -> None:
    work.wait(_delta(timeout_s))


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def finish_device_work(device: torch.device) -> None:
    # NCCL's wait orders the current stream only: the bytes are there (sent, or landed) once
    # the stream has run, which the ack and the buffer's reuse must come after.
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()

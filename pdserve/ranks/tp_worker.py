"""A worker rank of a tensor-parallel node: its slice of the model, its KV heads, its own KV transport.

Started by rank 0 (pdserve/ranks/tp_group.py) with a `WorkerSpec`; lives exactly as long as rank 0:

    pin to its cores ─▶ join the gloo group ─▶ load its slice (pdserve/engine/parallel.py)
    ─▶ `Start`: caches (and swap space) sized to rank 0's block counts, the step buffer mapped, its caches
       registered with a KV transport of its own (a node that moves KV) ─▶ `Ready`
    ─▶ serve rank 0's commands (pdserve/ranks/tp_wire.py) in order, until `Stop` or rank 0 is gone:
         Step       the step's block copies in their order (copy-on-write, to and from its swap
                    space), then the forward on the batch in the step buffer (no sampling: rank 0 samples)
         Connect    open a rank connection to a peer node's rank (on a thread: never stalls steps)
         Push, SendDone   on its own transport; each reports its end to rank 0 as it happens
         Guard, Grant, Revoke   the write permits of a decode node's reservations

A failure is reported as `Failed` and ends the process; rank 0 then takes the node down.

Must never: schedule, sample or allocate blocks (rank 0 does), or outlive rank 0.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import threading

from pdserve.kv_transfer import KVTransferError, TransferState
from pdserve.ranks.tp_group import WorkerSpec
from pdserve.ranks.worker_link import COLLECTIVE_TIMEOUT_S
from pdserve.ranks.tp_wire import (Command, Connect, Connected, Done, Event, Failed, Grant, Granted, Guard, Handle,
                                   Push, Ready, Revoke, SendDone, Start, Step, StepBuffer, Stop, from_text,
                                   receive_command, send_event, to_text)

logger = logging.getLogger(__name__)
PARENT_CHECK_S = 1.0  # how often an idle worker checks that rank 0 is still its parent


def worker_main(spec: WorkerSpec) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {spec.log_prefix}-rank{spec.rank} "
                                                   f"%(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0's front answers Ctrl-C for the whole node
    events = _Events(spec)
    exit_code = 0
    try:
        _Worker(spec, events).run()
    except EOFError:
        pass  # rank 0 is gone: so is this rank
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which takes the node down
        logger.exception("rank %d failed", spec.rank)
        events.send(Failed(f"{type(exc).__name__}: {exc}"))
        exit_code = 1
    logging.shutdown()
    os._exit(exit_code)  # skip torch's and UCX's slow teardown, as the engine core does


class _Events:
    """The worker's side of its event pipe: several threads report on it."""

    def __init__(self, spec: WorkerSpec) -> None:
        self._conn = spec.events
        self._lock = threading.Lock()
        self.transport = None  # its counters ride along every event once it exists

    def send(self, event: Event) -> None:
        with self._lock:  # the counters are read under the lock: events leave in the order they were read
            if self.transport is not None:
                event.sent, event.received = self.transport.stats(), self.transport.recv_stats()
            try:
                send_event(self._conn, event)
            except (OSError, ValueError):
                pass  # rank 0 is gone; the command loop sees it and exits


class _Worker:
    def __init__(self, spec: WorkerSpec, events: _Events) -> None:
        self.spec = spec
        self.events = events
        self.commands = spec.commands

    def run(self) -> None:
        import torch

        from pdserve.engine.model_loader import load_model
        from pdserve.engine.model_runner import RankForward
        from pdserve.engine.parallel import TPShard
        from pdserve.common.affinity import pin_to_cpus

        from transformers.utils import logging as hf_logging

        spec, engine = self.spec, self.spec.engine
        hf_logging.disable_progress_bar()  # as in the engine core: no bars, no tqdm semaphore left behind
        pin_to_cpus(spec.cpus)
        if engine.num_threads is not None:
            torch.set_num_threads(engine.num_threads)
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        store = torch.distributed.TCPStore("127.0.0.1", spec.group_port, spec.size, is_master=False, timeout=timeout)
        torch.distributed.init_process_group("gloo", store=store, rank=spec.rank, world_size=spec.size,
                                             timeout=timeout)
        loaded = load_model(engine.model, engine.torch_dtype, engine.model_impl, TPShard(spec.rank, spec.size))
        start = self._next()
        if not isinstance(start, Start):
            raise ValueError(f"rank {spec.rank}: {type(start).__name__} before Start")
        forward = RankForward(loaded, start.num_blocks, engine.block_size, engine.torch_dtype,
                              engine.attention_backend, start.num_swap_blocks)
        buffer = StepBuffer(start.buffer, start.nbytes)
        transfer = _RankTransfer.start(spec, loaded, forward, self.events) if spec.transfer is not None else None
        logger.info("rank %d of %d on cpus %s with %d torch threads, KV heads %s", spec.rank, spec.size,
                    sorted(os.sched_getaffinity(0)), torch.get_num_threads(), loaded.local_kv_heads)
        self.events.send(Ready(transfer.descriptor if transfer is not None else None))
        while True:
            msg = self._next()
            if isinstance(msg, Step):
                forward.copy_blocks(msg.copies)  # before the forward, in the scheduler's order
                if msg.batch is not None:
                    forward(buffer.read(msg.batch))
            elif isinstance(msg, Stop):
                break
            elif transfer is not None:
                transfer.handle(msg)
            else:
                raise ValueError(f"rank {spec.rank} has no KV transport for {type(msg).__name__}")
        if transfer is not None:
            transfer.close()

    def _next(self) -> Command:
        """rank 0's next message; EOFError once rank 0 has gone (its pipe closed, or it died)."""
        while not self.commands.poll(PARENT_CHECK_S):
            if os.getppid() != self.spec.parent_pid:
                raise EOFError("rank 0 is gone")
        return receive_command(self.commands)


class _RankTransfer:
    """The worker's KV transport and what rank 0 asks of it."""

    def __init__(self, spec: WorkerSpec, transport, events: _Events) -> None:
        from pdserve.kv_transfer import WritePermits

        self.spec = spec
        self.transport = transport
        self.events = events
        self.permits = WritePermits()
        self.descriptor = transport.descriptor().to_bytes().decode()
        transport.set_done_callback(self._on_done)

    @classmethod
    def start(cls, spec: WorkerSpec, loaded, forward, events: _Events) -> _RankTransfer:
        from dataclasses import replace

        from pdserve.kv_transfer import make_transport
        from pdserve.ranks.kv_ranks import rank_cache_spec

        # Its own port, a free one: the node's --kv-port is rank 0's.
        transport = make_transport(replace(spec.transfer, port=0))
        transport.register(forward.k_caches, forward.v_caches, rank_cache_spec(spec.engine, loaded))
        events.transport = transport
        return cls(spec, transport, events)

    def handle(self, msg: Command) -> None:
        match msg:
            case Connect():
                threading.Thread(target=self._connect, args=(msg,), daemon=True).start()
            case Push() | SendDone():
                self._send(msg)
            case Guard():
                self.transport.guard_writes(self.permits)
            case Grant():
                self.permits.grant(msg.req_id, msg.block_ids)
                self.events.send(Granted(msg.reply_id))
            case Revoke():
                self.permits.revoke(msg.req_id)
            case _:
                raise ValueError(f"unexpected {type(msg).__name__} from rank 0")

    def _send(self, msg: Push | SendDone) -> None:
        try:
            if isinstance(msg, Push):
                handle = self.transport.push(msg.req_id, msg.src, msg.dst, head_range=msg.heads, peer=msg.peer)
            else:
                handle = self.transport.send_done(msg.req_id, from_text(msg.payload), peer=msg.peer)
        except (KVTransferError, ValueError) as exc:  # this transfer's failure, as on rank 0
            self.events.send(Handle(msg.handle_id, TransferState.FAILED, f"rank {self.spec.rank}: {exc}"))
            return
        self._watch(msg.handle_id, handle)

    def _connect(self, msg: Connect) -> None:
        from pdserve.kv_transfer import FingerprintMismatch, KVDescriptor

        try:
            peer = self.transport.connect(KVDescriptor.from_bytes(msg.descriptor.encode()))
            self.events.send(Connected(msg.reply_id, peer=peer))
        except FingerprintMismatch as exc:
            self.events.send(Connected(msg.reply_id, diffs={k: list(v) for k, v in exc.diffs.items()}))
        except Exception as exc:  # noqa: BLE001 - the connect's failure is rank 0's to report
            self.events.send(Connected(msg.reply_id, error=f"{type(exc).__name__}: {exc}"))

    def _on_done(self, req_id: str, payload: bytes) -> None:
        self.transport.poll_done()  # rank 0 collects it from this event: nothing piles up here
        self.events.send(Done(req_id, to_text(payload)))

    def _watch(self, handle_id: int, handle) -> None:
        """Report the push or done message to rank 0 the moment it ends (on the transport's thread)."""
        handle.add_done_callback(lambda ended: self.events.send(Handle(handle_id, ended.poll(), ended.error)))

    def close(self) -> None:
        self.transport.close()

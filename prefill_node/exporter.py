"""The KV exporter of a prefill node: moves each request's KV into its decode node's blocks.

One request's export (the core drives it: `track`, `after_step`, `abort`, `poll`):

    track ─▶ PREFILLING ── after every engine step, push the blocks that became full
               │            since the last push (src: this node's block ids, dst: the
               │            decode node's reserved ids at the same positions)
               ▼ token 1 sampled: the engine hands the request off, its blocks in the output
             SENDING ───── push the rest (incl. the partial last block), then
               │            send_done(token 1 + logprobs), queued behind the pushes
               ▼ every handle SUCCESS
             free this node's blocks, FirstToken ─▶ gone

    connect failure, a FAILED handle, the lease, or abort ─▶ ABORTING: the engine drops
    the request, the decode node gets an "aborted" done message (behind the pushes, so
    it knows nothing more will land), the RPC fails (FAILED_PRECONDITION for mismatched
    KV caches, UNAVAILABLE otherwise; nothing when the caller itself cancelled), and the
    blocks are freed once no push can still be reading them ─▶ gone

A preempted request (recompute) starts pushing again from block 0; pushes on one
connection land in order, so the recomputed bytes overwrite anything stale.

Must never: free a block a push may still read, block on the network, or answer an
RPC twice.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.engine.block_pool import KVBlock
from pdserve.engine.engine_core import EngineCore, EngineCoreOutput
from pdserve.engine.request import Request
from pdserve.kv_transfer import KVDescriptor, KVTransferError, KVTransport, TransferHandle, TransferState
from pdserve.node.core_part import ToFront
from pdserve.node.errors import ErrorCode, NodeError
from pdserve.node.kv_done import DoneStatus, KVDone
from pdserve.node.messages import FirstToken, Logprobs, RequestFailed
from pdserve.prefill_node.peers import PeerConnections


class ExportPhase(enum.Enum):
    PREFILLING = "prefilling"
    SENDING = "sending"
    ABORTING = "aborting"


@dataclass(slots=True, eq=False)
class Export:
    request: Request
    peer_key: str
    dst_block_ids: list[int]
    arrived_at: float
    deadline: float
    phase: ExportPhase = ExportPhase.PREFILLING
    peer_id: str | None = None  # the transport's name for the peer, once connected
    peer_failed: bool = False  # the connection could not be made: nothing was ever sent
    num_pushed: int = 0  # leading blocks pushed (or being pushed)
    preemptions_seen: int = 0
    handles: list[TransferHandle] = field(default_factory=list)
    blocks: list[KVBlock] | None = None  # held here once the engine let go of the request
    first: EngineCoreOutput | None = None
    first_at: float = 0.0
    flushed: bool = False  # the rest pushed and the done message queued
    abort_sent: bool = False
    transfer_failed: bool = False  # a push failed: the connection is broken and was forgotten
    reply: bool = True  # False once the RPC is answered or its caller went away

    @property
    def req_id(self) -> str:
        return self.request.req_id


def plan_push(num_pushed: int, num_ready: int, src_block_ids: list[int],
              dst_block_ids: list[int]) -> tuple[list[int], list[int]]:
    """The push for block positions [num_pushed, num_ready): (this node's ids, the decode node's ids)."""
    if not 0 <= num_pushed <= num_ready <= min(len(src_block_ids), len(dst_block_ids)):
        raise ValueError(f"cannot push blocks [{num_pushed}, {num_ready}) of {len(src_block_ids)} held "
                         f"and {len(dst_block_ids)} reserved")
    return list(src_block_ids[num_pushed:num_ready]), list(dst_block_ids[num_pushed:num_ready])


class KVExporter:
    def __init__(self, engine: EngineCore, transport: KVTransport, peers: PeerConnections, lease_s: float,
                 to_front: ToFront) -> None:
        self.engine = engine
        self.transport = transport
        self.peers = peers
        self.lease_s = lease_s
        self.to_front = to_front
        self.block_size = engine.kv.block_size
        self._exports: dict[str, Export] = {}

    def has_pending(self) -> bool:
        return bool(self._exports)

    def is_tracking(self, req_id: str) -> bool:
        return req_id in self._exports

    def num_held_blocks(self) -> int:
        """Blocks of handed-off or aborted requests still held for their pushes."""
        return sum(len(e.blocks) for e in self._exports.values() if e.blocks)

    def track(self, request: Request, descriptor: KVDescriptor, dst_block_ids: list[int], now: float) -> None:
        key = self.peers.request(descriptor)
        self._exports[request.req_id] = Export(request, key, list(dst_block_ids), now, now + self.lease_s)

    def after_step(self, outputs: list[EngineCoreOutput], now: float) -> None:
        for out in outputs:
            export = self._exports.get(out.req_id)
            if export is None:  # not exported (cannot happen through the core): free at once
                self.engine.kv.pool.free(reversed(out.handoff_blocks or []))
                continue
            export.first, export.first_at, export.phase = out, now, ExportPhase.SENDING
            export.blocks = out.handoff_blocks
        for export in list(self._exports.values()):
            self._advance(export)

    def abort(self, req_id: str) -> None:
        """The caller went away: stop the request (blocks are freed once pushes end)."""
        export = self._exports.get(req_id)
        if export is None:
            return
        export.reply = False
        if export.phase is ExportPhase.PREFILLING:
            self._fail(export, None)

    def poll(self, now: float) -> None:
        for export in list(self._exports.values()):
            self._advance(export)
            self._check(export, now)
        self.peers.prune_failed()

    # -- pushing -----------------------------------------------------------------------
    def _advance(self, export: Export) -> None:
        if export.peer_id is None and not self._resolve_peer(export):
            return
        if export.phase is ExportPhase.PREFILLING:
            request = export.request
            if request.num_preemptions != export.preemptions_seen:
                export.preemptions_seen, export.num_pushed = request.num_preemptions, 0
            num_full = request.num_computed_tokens // self.block_size
            self._push(export, self.engine.kv.block_ids(export.req_id), num_full)
        elif export.phase is ExportPhase.SENDING and not export.flushed:
            self._flush(export)
        elif export.phase is ExportPhase.ABORTING:
            self._send_abort(export)

    def _resolve_peer(self, export: Export) -> bool:
        peer_id, error = self.peers.state(export.peer_key)
        if error is not None:
            export.peer_failed = True
            self._fail(export, error)
        export.peer_id = peer_id
        return peer_id is not None

    def _flush(self, export: Export) -> None:
        assert export.blocks is not None and export.first is not None  # set together with SENDING
        if not self._push(export, [b.block_id for b in export.blocks], len(export.dst_block_ids)):
            return
        done = KVDone(DoneStatus.OK, export.first.new_token_id, Logprobs.of(export.first.logprobs))
        try:
            export.handles.append(self.transport.send_done(export.req_id, done.to_bytes(), peer=export.peer_id))
        except (KVTransferError, ValueError) as exc:
            self._fail(export, NodeError(ErrorCode.UNAVAILABLE, f"cannot send the KV done message: {exc}"))
            return
        export.flushed = True

    def _push(self, export: Export, src_block_ids: list[int], num_ready: int) -> bool:
        try:
            src, dst = plan_push(export.num_pushed, num_ready, src_block_ids, export.dst_block_ids)
            if src:
                export.handles.append(self.transport.push(export.req_id, src, dst, peer=export.peer_id))
        except (KVTransferError, ValueError) as exc:
            self._fail(export, NodeError(ErrorCode.UNAVAILABLE, f"cannot push KV to {export.peer_key}: {exc}"))
            return False
        export.num_pushed = num_ready
        return True

    def _send_abort(self, export: Export) -> None:
        if export.abort_sent or export.peer_id is None:
            return
        export.abort_sent = True
        try:
            self.transport.send_done(export.req_id, KVDone(DoneStatus.ABORTED).to_bytes(), peer=export.peer_id)
        except (KVTransferError, ValueError):
            pass  # the peer is gone: its lease frees its blocks

    # -- ending ------------------------------------------------------------------------
    def _fail(self, export: Export, error: NodeError | None) -> None:
        if export.phase is ExportPhase.ABORTING:
            return
        if export.phase is ExportPhase.PREFILLING:
            export.blocks = self.engine.detach(export.req_id)  # pushes may still read them
        export.phase = ExportPhase.ABORTING
        if error is not None and export.reply:
            self.to_front(RequestFailed(export.req_id, error.code, error.message))
        export.reply = False
        self._send_abort(export)

    def _check(self, export: Export, now: float) -> None:
        failed = next((h for h in export.handles if h.poll() is TransferState.FAILED), None)
        if failed is not None and not export.transfer_failed:
            # Even when the lease already aborted the export: a broken connection is forgotten,
            # or every later request to that decode node would fail on it.
            export.transfer_failed = True
            self.peers.forget(export.peer_key)
            self._fail(export, NodeError(ErrorCode.UNAVAILABLE, f"KV transfer to {export.peer_key} failed: "
                                                                f"{failed.error}"))
        elif now > export.deadline and export.phase is not ExportPhase.ABORTING:
            self._fail(export, NodeError(ErrorCode.UNAVAILABLE, f"the decode node did not acknowledge the KV "
                                                                f"within the {self.lease_s}s lease"))
        if not all(h.done for h in export.handles) or export.blocks is None:
            return
        if export.phase is ExportPhase.SENDING and export.flushed:
            self._succeed(export)
        elif export.phase is ExportPhase.ABORTING and (export.abort_sent or export.peer_failed):
            self._release(export)

    def _succeed(self, export: Export) -> None:
        assert export.first is not None
        finished = [h.finished_at for h in export.handles if h.finished_at is not None]
        if export.reply:
            self.to_front(FirstToken(
                req_id=export.req_id,
                token_id=export.first.new_token_id,
                logprobs=Logprobs.of(export.first.logprobs),
                num_cached_tokens=export.first.num_cached_tokens,
                prefill_s=export.first_at - export.arrived_at,
                kv_transfer_s=max(0.0, max(finished, default=export.first_at) - export.first_at),
                kv_transfer_bytes=sum(h.nbytes for h in export.handles),
            ))
        self._release(export)

    def _release(self, export: Export) -> None:
        del self._exports[export.req_id]
        if export.blocks:
            self.engine.kv.pool.free(reversed(export.blocks))

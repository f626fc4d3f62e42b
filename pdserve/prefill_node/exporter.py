"""The KV exporter of a prefill node: moves each request's KV into its decode node's blocks.

One request's export, in the hand-off states of pdserve/node/core/handoff.py (the core drives it:
`track`, `after_step`, `abort`, `poll`; `_move` is the one place that changes a state):

    track ─▶ BOOTSTRAPPING ──── the connection to the decode node is being made (off the
               │                 step loop); the engine computes the prompt meanwhile
               ▼ connected
             WAITING_FOR_INPUT ─ after every engine step, push the blocks that became full
               │                 since the last push (src: this node's block ids, dst: the
               │                 decode node's reserved ids at the same positions)
               ▼ token 1 sampled: the engine hands the request off, its blocks in the output;
               │ the rest is pushed (incl. the partial last block), then
               │ send_done(token 1 + logprobs), queued behind the pushes, and FirstToken
               │ goes to the front at once: token 1 leaves while the transfer completes
             TRANSFERRING ────── waiting for every push and the done message to be acknowledged
               ▼ all acknowledged
             SUCCESS ─────────── this node's blocks freed ─▶ gone

    a failed connection, a FAILED push, the lease, or the caller's abort while the engine
    still has the request ─▶ FAILED: the engine lets go of the request (its blocks come
    here, still held), the decode node gets an "aborted" done message once connected
    (behind the pushes, so it knows nothing more will land), the RPC fails
    (FAILED_PRECONDITION for mismatched KV caches, UNAVAILABLE otherwise; nothing when the
    caller itself went away), and the blocks are freed once no push can still read them
    ─▶ gone. After token 1 the RPC has been answered: a failure then reaches the client
    through the decode node (the aborted done message fails its stream, and the router
    resumes the sample elsewhere); an abort then lets the transfer complete.

The lease (pdserve/node/core/lease.py) bounds only what the decode node has not acknowledged: it runs
while a push or the done message is unacknowledged, from the first such, afresh at each ack, so
a request queued behind others or a long prompt whose pushes land never expires it. Meanwhile,
every third of a lease, a connected export renews its decode node's reservation (a "renew" done
message, behind its pushes), whose lease would otherwise run out while this node queues or
computes the prompt.

A preempted request starts pushing again from block 0 (recomputed, or swapped back in to other
blocks: a push in flight may have read a block since reused); pushes on one connection land
in order, so the fresh bytes overwrite anything stale. A swapped-out request pushes nothing.
A sample pending as a fork of a sibling (pdserve/node/core/sibling_forks.py) has no blocks in the engine and
pushes nothing until its hand-off, which carries the sibling's prompt blocks by reference (ref
counts: each export frees its own references); promoted to a request of its own when the sibling
leaves first, it pushes like any other.

Must never: free a block a push may still read, or free one twice; block on the network;
answer an RPC twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.block_pool import KVBlock
from pdserve.engine.engine_core import EngineCore, EngineCoreOutput
from pdserve.engine.request import RequestStatus
from pdserve.kv_transfer import KVTransferError, TransferState
from pdserve.node.core.core_part import ToFront
from pdserve.node.errors import ErrorCode, NodeError
from pdserve.node.core.handoff import PREFILL_MOVES, HandoffState, OnMove
from pdserve.node.core.kv_done import DoneStatus, KVDone
from pdserve.node.core.lease import LeaseClock
from pdserve.ranks.kv_ranks import GroupHandle, NodeKVDescriptor, RankedTransport
from pdserve.node.messages import FirstToken, Logprobs, PromptLogprobs, RequestFailed
from pdserve.prefill_node.peers import PeerConnections


@dataclass(slots=True, eq=False)
class Export:
    req_id: str
    peer_key: str
    dst_block_ids: list[int]
    arrived_at: float
    lease: LeaseClock  # runs only while a push or the done message is unacknowledged
    renewed_at: float  # the decode node's reservation was last renewed (or made, about then)
    state: HandoffState = PREFILL_MOVES.first
    peer_id: str | None = None  # the transport's name for the decode node, once connected
    peer_error: NodeError | None = None  # the connection failed: nothing was ever sent
    num_pushed: int = 0  # leading blocks pushed (or being pushed)
    preemptions_seen: int = 0
    handles: list[GroupHandle] = field(default_factory=list)  # pushes and the done message, none failed
    num_acked: int = 0  # of `handles`, when the lease last looked
    blocks: list[KVBlock] | None = None  # held here once the engine let go of the request
    first: EngineCoreOutput | None = None  # token 1, once the engine handed the request off
    first_at: float = 0.0
    answer_caller: bool = True  # False once the RPC is answered or its caller went away

    @property
    def peer_resolved(self) -> bool:
        """Has the connection attempt ended (connected, or failed)?"""
        return self.peer_id is not None or self.peer_error is not None


def plan_push(num_pushed: int, num_ready: int, src_block_ids: list[int],
              dst_block_ids: list[int]) -> tuple[list[int], list[int]]:
    """The push for block positions [num_pushed, num_ready): (this node's ids, the decode node's ids)."""
    if not 0 <= num_pushed <= num_ready <= min(len(src_block_ids), len(dst_block_ids)):
        raise ValueError(f"cannot push blocks [{num_pushed}, {num_ready}) of {len(src_block_ids)} held "
                         f"and {len(dst_block_ids)} reserved")
    return list(src_block_ids[num_pushed:num_ready]), list(dst_block_ids[num_pushed:num_ready])


class KVExporter:
    def __init__(self, engine: EngineCore, transport: RankedTransport, peers: PeerConnections, lease_s: float,
                 to_front: ToFront, on_move: OnMove | None = None) -> None:
        self.engine = engine
        self.transport = transport
        self.peers = peers
        self.lease_s = lease_s
        self.to_front = to_front
        self.on_move = on_move
        self.block_size = engine.kv.block_size
        self._exports: dict[str, Export] = {}

    def has_pending(self) -> bool:
        return bool(self._exports)

    def is_tracking(self, req_id: str) -> bool:
        return req_id in self._exports

    def num_held_blocks(self) -> int:
        """Blocks of handed-off or aborted requests still held for their pushes."""
        return sum(len(e.blocks) for e in self._exports.values() if e.blocks)

    def track(self, req_id: str, descriptor: NodeKVDescriptor, dst_block_ids: list[int], now: float) -> None:
        export = Export(req_id, self.peers.request(descriptor), list(dst_block_ids), now, LeaseClock(self.lease_s),
                        renewed_at=now)
        self._exports[req_id] = export
        if self.on_move is not None:
            self.on_move(req_id, export.state)

    def after_step(self, outputs: list[EngineCoreOutput], now: float) -> None:
        for out in outputs:
            export = self._exports.get(out.req_id)
            if export is None:  # not exported (cannot happen through the core): free at once
                self.engine.kv.pool.free(reversed(out.handoff_blocks or []))
                continue
            export.first, export.first_at, export.blocks = out, now, out.handoff_blocks
        for export in list(self._exports.values()):
            self._advance(export, now)

    def abort(self, req_id: str) -> None:
        """The caller went away: stop computing the request (its blocks are freed once pushes end)."""
        export = self._exports.get(req_id)
        if export is None:
            return
        export.answer_caller = False
        if export.blocks is None:  # still in the engine; after token 1 the transfer just completes
            self._fail(export, None)

    def fail(self, req_id: str, message: str) -> None:
        """A step of the request raised: answer its caller INTERNAL, free it, tell its decode node."""
        export = self._exports.get(req_id)
        if export is not None:
            self._fail(export, NodeError(ErrorCode.INTERNAL, message))

    def poll(self, now: float) -> None:
        for export in list(self._exports.values()):
            self._advance(export, now)
            self._check(export, now)
            self._renew(export, now)
        self.peers.prune_failed()

    # -- the one place a state changes ---------------------------------------------------
    def _move(self, export: Export, state: HandoffState) -> None:
        PREFILL_MOVES.check(export.req_id, export.state, state)
        export.state = state
        if self.on_move is not None:
            self.on_move(export.req_id, state)

    # -- pushing -----------------------------------------------------------------------
    def _advance(self, export: Export, now: float) -> None:
        if not export.peer_resolved:
            self._connect(export)
        if export.state is not HandoffState.WAITING_FOR_INPUT:
            return
        if export.first is None:
            self._push_computed(export)
        else:
            self._flush(export, now)
        self._watch_lease(export, now)

    def _watch_lease(self, export: Export, now: float) -> None:
        """Start the lease when something goes unacknowledged, renew it at each ack, stop it when all are."""
        num_acked = sum(h.done for h in export.handles)
        if num_acked == len(export.handles):
            export.lease.stop()
        elif num_acked != export.num_acked or not export.lease.running:
            export.lease.renew(now)
        export.num_acked = num_acked

    def _renew(self, export: Export, now: float) -> None:
        """Tell the decode node this node still holds the request, so its reservation lives on."""
        if export.peer_id is None or export.state not in (HandoffState.WAITING_FOR_INPUT, HandoffState.TRANSFERRING):
            return
        if not export.lease.renewal_due(export.renewed_at, now):
            return
        export.renewed_at = now
        try:  # not tracked: a broken connection fails the pushes, whose handles say so
            self.transport.send_done(export.req_id, KVDone(DoneStatus.RENEW).to_bytes(), peer=export.peer_id)
        except (KVTransferError, ValueError):
            pass

    def _connect(self, export: Export) -> None:
        peer_id, error = self.peers.state(export.peer_key)
        if error is not None:
            export.peer_error = error
            self._fail(export, error)
        elif peer_id is not None:
            export.peer_id = peer_id
            if export.state is HandoffState.FAILED:  # it failed while connecting: tell the decode node now
                self._send_abort(export)
            else:
                self._move(export, HandoffState.WAITING_FOR_INPUT)

    def _push_computed(self, export: Export) -> None:
        request = self.engine.request(export.req_id)
        if request is None:
            return  # a pending fork: its blocks are its parent's until the fork, then all pushed at hand-off
        if request.num_preemptions != export.preemptions_seen:
            export.preemptions_seen, export.num_pushed = request.num_preemptions, 0
        if request.status is RequestStatus.SWAPPED:
            return  # its KV is in host blocks until it is swapped back in
        num_full = request.num_computed_tokens // self.block_size
        self._push(export, self.engine.kv.block_ids(export.req_id), num_full)

    def _flush(self, export: Export, now: float) -> None:
        assert export.blocks is not None and export.first is not None  # set together by the hand-off
        if not self._push(export, [b.block_id for b in export.blocks], len(export.dst_block_ids)):
            return
        done = KVDone(DoneStatus.OK, export.first.new_token_id, Logprobs.of(export.first.logprobs),
                      self.transport.done_parts(export.peer_id))
        try:
            export.handles.append(self.transport.send_done(export.req_id, done.to_bytes(), peer=export.peer_id))
        except (KVTransferError, ValueError) as exc:
            self._fail(export, NodeError(ErrorCode.UNAVAILABLE, f"cannot send the KV done message: {exc}"))
            return
        self._move(export, HandoffState.TRANSFERRING)
        self._answer(export, now)

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
        try:
            self.transport.send_done(export.req_id, KVDone(DoneStatus.ABORTED).to_bytes(), peer=export.peer_id)
        except (KVTransferError, ValueError):
            pass  # the peer is gone: its lease frees its blocks

    # -- ending ------------------------------------------------------------------------
    def _fail(self, export: Export, error: NodeError | None) -> None:
        if export.state is HandoffState.FAILED:
            return
        if export.blocks is None:
            export.blocks = self.engine.detach(export.req_id)  # held: pushes may still read them
        self._move(export, HandoffState.FAILED)
        if error is not None and export.answer_caller:
            self.to_front(RequestFailed(export.req_id, error.code, error.message))
        export.answer_caller = False
        if export.peer_id is not None:  # else `_connect` tells the decode node once connected
            self._send_abort(export)

    def _check(self, export: Export, now: float) -> None:
        failed = [h for h in export.handles if h.poll() is TransferState.FAILED]
        if failed:
            # Each failed handle is seen once: the broken connection is forgotten once, even when
            # the lease already failed the export, or every later request to that decode node
            # would fail on it; a connection made afresh in the meantime stays.
            export.handles = [h for h in export.handles if h not in failed]
            self.peers.forget(export.peer_key)
            self._fail(export, NodeError(ErrorCode.UNAVAILABLE, f"KV transfer to {export.peer_key} failed: "
                                                                f"{failed[0].error}"))
        elif export.state is not HandoffState.FAILED and self._lease_over(export, now):
            self._fail(export, NodeError(ErrorCode.UNAVAILABLE, f"the decode node acknowledged nothing of the KV "
                                                                f"for the {self.lease_s}s lease"))
        if not all(h.done for h in export.handles):
            return
        if export.state is HandoffState.TRANSFERRING:
            self._succeed(export)
        elif export.state is HandoffState.FAILED and export.peer_resolved:
            self._release(export)

    def _lease_over(self, export: Export, now: float) -> bool:
        self._watch_lease(export, now)
        return export.lease.expired(now)

    def _answer(self, export: Export, now: float) -> None:
        """Token 1 to the front, as soon as the whole transfer is queued behind it."""
        assert export.first is not None  # TRANSFERRING follows the hand-off
        if not export.answer_caller:
            return
        export.answer_caller = False
        self.to_front(FirstToken(
            req_id=export.req_id,
            token_id=export.first.new_token_id,
            logprobs=Logprobs.of(export.first.logprobs),
            num_cached_tokens=export.first.num_cached_tokens,
            prefill_s=export.first_at - export.arrived_at,
            kv_transfer_s=now - export.first_at,  # how long token 1 waited on the transfer (its connection)
            kv_transfer_bytes=sum(h.nbytes for h in export.handles),  # every push is queued by now
            # Scored here with the prompt; they go to the client with token 1 (the decode node needs none).
            prompt_logprobs=PromptLogprobs.of(export.first.prompt_logprobs),
        ))

    def _succeed(self, export: Export) -> None:
        self._move(export, HandoffState.SUCCESS)
        self._release(export)

    def _release(self, export: Export) -> None:
        """The one place an export's blocks are freed: it leaves the table with them."""
        del self._exports[export.req_id]
        if export.blocks:
            self.engine.kv.pool.free(reversed(export.blocks))

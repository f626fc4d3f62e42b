"""The prefill node's KV export stage: admit prefills, export their KV.

A stage of the node core (pdserve/node/core/node_core.py); `make_stage` builds it in the engine-core process
(the kind's row, pdserve/node_kinds.py, names it: a prefill node's, and a decode node's with
--serve-prefill, beside its import stage). It takes every `PrefillSubmit`: finds the decode
node's layout its `kv_layout_id` names (pdserve/prefill_node/decode_layouts.py: parsed once per decode node
run), checks the request against it (its block ids must name exactly one reserved block per
prompt block, inside its cache: INVALID_ARGUMENT otherwise) and against the queue bounds
(RESOURCE_EXHAUSTED at once when full), adds the request to the engine to leave at token 1
(`hands_off`, whatever the engine's policy; RESOURCE_EXHAUSTED if its KV can never fit here; a
sibling sample of a request still in its prefill is forked off it, pdserve/node/core/sibling_forks.py)
and hands it to the exporter; everything after
that, the hand-off of its KV to the decode node at token 1, is the exporter's
(pdserve/prefill_node/exporter.py). The step outputs it takes are those hand-offs.

Must never: answer a request itself once the exporter has it, or free blocks.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

from pdserve.engine.admission import RequestRejected
from pdserve.engine.engine_core import EngineCoreOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.config import NodeConfig
from pdserve.node.errors import ErrorCode, NodeError, rejection_error
from pdserve.ranks.kv_ranks import NodeKVDescriptor, RankedTransport
from pdserve.node.messages import Message, PrefillSubmit, RequestFailed
from pdserve.node.core.node_core import NodeCore
from pdserve.node.core.sibling_forks import add_sample
from pdserve.node.core.stats import UNBOUNDED, QueueBounds, queued_tokens
from pdserve.prefill_node.decode_layouts import DecodeLayouts
from pdserve.prefill_node.exporter import KVExporter
from pdserve.prefill_node.peers import PeerConnections


class KVExportStage:
    def __init__(self, core: NodeCore, exporter: KVExporter, bounds: QueueBounds = UNBOUNDED) -> None:
        self.core = core
        self.engine = core.engine
        self.exporter = exporter
        self.bounds = bounds
        self.layouts = DecodeLayouts(exporter.peers.forget)

    def handle(self, msg: Message) -> bool:
        if not isinstance(msg, PrefillSubmit):
            return False
        try:
            self._submit(msg)
        except NodeError as exc:
            self.core.to_front(RequestFailed(msg.req_id, exc.code, exc.message))
        return True

    def abort(self, req_id: str) -> bool:
        if not self.exporter.is_tracking(req_id):
            return False
        self.exporter.abort(req_id)
        return True

    def fail(self, req_id: str, message: str) -> bool:
        if not self.exporter.is_tracking(req_id):
            return False
        self.exporter.fail(req_id, message)
        return True

    def _submit(self, msg: PrefillSubmit) -> None:
        if self.exporter.is_tracking(msg.req_id):
            # Its blocks may still be read by pushes: the id is taken until they finish.
            raise NodeError(ErrorCode.INVALID_ARGUMENT, f"request_id {msg.req_id!r} is still being exported here")
        descriptor = self.layouts.resolve(msg.kv_layout_id, msg.kv_layout)
        num_tokens = len(msg.prompt_token_ids) + len(msg.resumed_token_ids)  # what this node computes
        _check_dst_blocks(msg, descriptor, self.engine.kv.blocks_needed(num_tokens))
        self.bounds.check(len(self.engine.scheduler.waiting), queued_tokens(self.engine), num_tokens)
        try:
            add_sample(self.engine, msg.req_id, msg.prompt_token_ids, prefill_params(msg.params, len(msg.resumed_token_ids)),
                       msg.sample_index, msg.resumed_token_ids, hands_off=True)  # the exporter takes it at token 1
        except RequestRejected as exc:
            raise rejection_error(exc) from exc
        self.exporter.track(msg.req_id, descriptor, msg.dst_block_ids, time.monotonic())

    def take(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        handoffs = [out for out in outputs if out.handoff_blocks is not None]
        self.exporter.after_step(handoffs, time.monotonic())  # every step: it advances the pushes too
        return [out for out in outputs if out.handoff_blocks is None]

    def poll(self, now: float) -> None:
        self.exporter.poll(now)

    def wants_fast_poll(self) -> bool:
        return self.exporter.has_pending()  # push acks arrive without waking the loop

    def num_held_blocks(self) -> int:
        return self.exporter.num_held_blocks()


def prefill_params(params: SamplingParams, num_resumed: int = 0) -> SamplingParams:
    """The params this node runs: the same draw for token 1, capacity checked for the prompt only.

    A prefill node samples one token, so `max_tokens` would only make the engine refuse
    prompts whose *decode* would not fit here. Token 1's min_tokens masking depends only
    on whether min_tokens >= 1, which `min(min_tokens, 1)` keeps. A resume samples the
    token after `num_resumed` output tokens: the same rules, one position further.
    """
    num_sampled = num_resumed + 1
    return dataclasses.replace(params, max_tokens=num_sampled, min_tokens=min(params.min_tokens, num_sampled))


def _check_dst_blocks(msg: PrefillSubmit, descriptor: NodeKVDescriptor, num_needed: int) -> None:
    ids = msg.dst_block_ids
    if len(ids) != num_needed:
        num_tokens = len(msg.prompt_token_ids) + len(msg.resumed_token_ids)
        raise NodeError(ErrorCode.INVALID_ARGUMENT, f"decode_block_ids has {len(ids)} blocks; a prompt (with "
                                                    f"resumed tokens) of {num_tokens} tokens needs {num_needed}")
    if len(set(ids)) != len(ids) or not all(0 <= b < descriptor.num_blocks for b in ids):
        raise NodeError(ErrorCode.INVALID_ARGUMENT, f"decode_block_ids must be distinct ids in "
                                                    f"[0, {descriptor.num_blocks})")


def make_stage(config: NodeConfig, core: NodeCore, transport: RankedTransport,
               descriptor: NodeKVDescriptor) -> KVExportStage:
    # One worker: connecting to a new decode node never stalls the step loop.
    peers = PeerConnections(transport, ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-kv-connect"))
    exporter = KVExporter(core.engine, transport, peers, config.lease_s, core.to_front)
    return KVExportStage(core, exporter, QueueBounds(config.max_waiting_requests, config.max_queued_tokens))

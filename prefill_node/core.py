"""The prefill node's part of the engine core: admit prefills, export their KV.

`make_handler` builds it in the engine-core process (the front names it in its `CorePart`,
prefill_node/server.py). `PrefillCore.handle` checks a `PrefillSubmit` against the
decode node's descriptor (its block ids must name exactly one reserved block per prompt
block, inside its cache: INVALID_ARGUMENT otherwise) and against the queue bounds
(RESOURCE_EXHAUSTED at once when full), adds the request to the engine (prefill-only
policy: RESOURCE_EXHAUSTED if its KV can never fit here; a sibling sample of a request still
in its prefill is forked off it, node/sibling_forks.py) and hands it to the exporter;
everything after that, the hand-off of its KV to the decode node, is the exporter's.

Must never: answer a request itself once the exporter has it, or free blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from pdserve.engine.admission import RequestRejected
from pdserve.engine.engine_core import EngineCore, EngineCoreOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.config import NodeConfig
from pdserve.node.core_part import ToFront
from pdserve.node.errors import ErrorCode, NodeError, rejection_error
from pdserve.node.kv_ranks import NodeKVDescriptor, RankedTransport
from pdserve.node.messages import Abort, Message, PrefillSubmit, RequestFailed
from pdserve.node.sibling_forks import add_sample
from pdserve.node.stats import UNBOUNDED, QueueBounds, queued_tokens
from pdserve.prefill_node.exporter import KVExporter
from pdserve.prefill_node.peers import PeerConnections

logger = logging.getLogger(__name__)


class PrefillCore:
    def __init__(self, engine: EngineCore, exporter: KVExporter, to_front: ToFront,
                 bounds: QueueBounds = UNBOUNDED) -> None:
        self.engine = engine
        self.exporter = exporter
        self.to_front = to_front
        self.bounds = bounds

    def handle(self, msg: Message) -> None:
        if isinstance(msg, PrefillSubmit):
            try:
                self._submit(msg)
            except NodeError as exc:
                self.to_front(RequestFailed(msg.req_id, exc.code, exc.message))
        elif isinstance(msg, Abort):
            self.exporter.abort(msg.req_id)
        else:
            logger.warning("prefill core ignores %s", type(msg).__name__)

    def fail(self, req_id: str, message: str) -> None:
        self.exporter.fail(req_id, message)

    def _submit(self, msg: PrefillSubmit) -> None:
        if self.exporter.is_tracking(msg.req_id):
            # Its blocks may still be read by pushes: the id is taken until they finish.
            raise NodeError(ErrorCode.INVALID_ARGUMENT, f"request_id {msg.req_id!r} is still being exported here")
        descriptor = _descriptor(msg.kv_descriptor)
        num_tokens = len(msg.prompt_token_ids) + len(msg.resumed_token_ids)  # what this node computes
        _check_dst_blocks(msg, descriptor, self.engine.kv.blocks_needed(num_tokens))
        self.bounds.check(len(self.engine.scheduler.waiting), queued_tokens(self.engine), num_tokens)
        try:
            add_sample(self.engine, msg.req_id, msg.prompt_token_ids,
                       prefill_params(msg.params, len(msg.resumed_token_ids)), msg.sample_index, msg.resumed_token_ids)
        except RequestRejected as exc:
            raise rejection_error(exc) from exc
        self.exporter.track(msg.req_id, descriptor, msg.dst_block_ids, time.monotonic())

    def after_step(self, outputs: list[EngineCoreOutput]) -> None:
        self.exporter.after_step(outputs, time.monotonic())

    def poll(self, now: float) -> None:
        self.exporter.poll(now)

    def wants_fast_poll(self) -> bool:
        return self.exporter.has_pending()  # push acks arrive without waking the loop

    def num_blocks_outside_scheduler(self) -> int:
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


def _descriptor(raw: str) -> NodeKVDescriptor:
    try:
        return NodeKVDescriptor.from_bytes(raw.encode())
    except (ValueError, KeyError, TypeError) as exc:
        raise NodeError(ErrorCode.INVALID_ARGUMENT, f"decode_kv_descriptor is not a KV descriptor: {exc}") from exc


def _check_dst_blocks(msg: PrefillSubmit, descriptor: NodeKVDescriptor, num_needed: int) -> None:
    ids = msg.dst_block_ids
    if len(ids) != num_needed:
        num_tokens = len(msg.prompt_token_ids) + len(msg.resumed_token_ids)
        raise NodeError(ErrorCode.INVALID_ARGUMENT, f"decode_block_ids has {len(ids)} blocks; a prompt (with "
                                                    f"resumed tokens) of {num_tokens} tokens needs {num_needed}")
    if len(set(ids)) != len(ids) or not all(0 <= b < descriptor.num_blocks for b in ids):
        raise NodeError(ErrorCode.INVALID_ARGUMENT, f"decode_block_ids must be distinct ids in "
                                                    f"[0, {descriptor.num_blocks})")


def make_handler(config: NodeConfig, engine: EngineCore, transport: RankedTransport,
                 descriptor: NodeKVDescriptor, to_front: ToFront) -> PrefillCore:
    if not engine.policy.hands_off_after_first_token():  # the exporter takes requests at token 1
        raise TypeError(f"a prefill core needs a hand-off policy, got {type(engine.policy).__name__}")
    # One worker: connecting to a new decode node never stalls the step loop.
    peers = PeerConnections(transport, ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-kv-connect"))
    exporter = KVExporter(engine, transport, peers, config.lease_s, to_front)
    return PrefillCore(engine, exporter, to_front, QueueBounds(config.max_waiting_requests, config.max_queued_tokens))

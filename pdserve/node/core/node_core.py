"""The request-level handler of every node kind's engine core: one node core, plus the KV stages
a kind adds (a decode node's import, pdserve/decode_node/kv_import.py; a prefill node's export,
pdserve/prefill_node/kv_export.py). A kind is a row of pdserve/node_kinds.py: policy, stages, services.

A request's life through the core, whatever the kind:

    StreamSubmit of a prompt to compute here ─▶ admit into the engine (prompt, plus resumed tokens
        on a resume; a sibling sample of a request still in its prefill is forked off it,
        pdserve/node/core/sibling_forks.py) or RequestFailed at once:
          RESOURCE_EXHAUSTED  — the queue bounds are full, or prompt + max_tokens need more KV
                                blocks than this node has (another node may be bigger)
          INVALID_ARGUMENT    — anything else the engine refuses
          FAILED_PRECONDITION — this node computes no prompts of its own (a decode node without
                                --local-prefill, a prefill node)
    a message a stage takes (a StreamSubmit whose KV comes from a prefill node; a PrefillSubmit)
        ─▶ that stage
    each step ─▶ beam searches take their beams' outputs, then each stage what it consumes (the
        export stage: requests handed off at token 1); the rest stream as Tokens{[token],
        [logprobs]}, the last with finish_reason (token 1's with the prompt logprobs, if asked)
    Abort ─▶ the stage that holds the request, else its beam search, else the engine
    a step that raised (StepFailed, pdserve/node/core/core_loop.py) ─▶ `fail`: RequestFailed(INTERNAL), freed

A beam search (StreamSubmit.beam set) runs as `BeamSearches` (pdserve/engine/beam_runner.py) beside the
ordinary requests; its answer is one BeamsDone once it ends; an Abort drops every beam it holds.

Must never: hold a block outside the scheduler itself (a stage counts its own), or answer a
request twice.
"""

from __future__ import annotations

import logging
from typing import Protocol

from pdserve.engine.admission import RequestRejected
from pdserve.engine.beam_runner import BeamSearches
from pdserve.engine.engine_core import EngineCore, EngineCoreOutput
from pdserve.node.core.beam_searches import beam_params, beams_done
from pdserve.node.config import NodeConfig
from pdserve.node.core.core_part import ToFront
from pdserve.node.errors import ErrorCode, NodeError, rejection_error
from pdserve.node.messages import Abort, Logprobs, Message, PromptLogprobs, RequestFailed, StreamSubmit, Tokens
from pdserve.node.core.sibling_forks import add_sample
from pdserve.node.core.stats import UNBOUNDED, QueueBounds, queued_tokens

logger = logging.getLogger(__name__)


class KVStage(Protocol):
    """What a kind adds to the node core: the requests whose KV moves between nodes."""

    def handle(self, msg: Message) -> bool:
        """Take a front message meant for this stage (True), or leave it to the core (False)."""

    def take(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """The step's outputs this stage does not consume, in order."""

    def poll(self, now: float) -> None:
        """Advance transfers, take done messages, enforce leases."""

    def abort(self, req_id: str) -> bool:
        """The caller went away: drop a request this stage holds (True), else False."""

    def fail(self, req_id: str, message: str) -> bool:
        """A step of a request this stage holds raised: answer INTERNAL and free it (True), else False."""

    def wants_fast_poll(self) -> bool:
        """Is something outstanding that only polling advances, and soon?"""

    def num_held_blocks(self) -> int:
        """Blocks this stage holds that no scheduled request does (stats report them as reserved)."""


class NodeCore:
    """The node kinds' one `CoreHandler` (pdserve/node/core/core_part.py)."""

    def __init__(self, engine: EngineCore, to_front: ToFront, bounds: QueueBounds = UNBOUNDED,
                 local_prefill: bool = True) -> None:
        self.engine = engine
        self.to_front = to_front
        self.bounds = bounds
        self.local_prefill = local_prefill  # does this node compute prompts of its own?
        self.beams = BeamSearches(engine)
        self.stages: list[KVStage] = []

    def handle(self, msg: Message) -> None:
        if any(stage.handle(msg) for stage in self.stages):
            return
        if isinstance(msg, StreamSubmit):
            try:
                self._admit(msg)
            except NodeError as exc:
                self.to_front(RequestFailed(msg.req_id, exc.code, exc.message))
        elif isinstance(msg, Abort):
            self._abort(msg.req_id)
        else:
            logger.warning("node core ignores %s", type(msg).__name__)

    def fail(self, req_id: str, message: str) -> None:
        if any(stage.fail(req_id, message) for stage in self.stages):
            return
        caller = self.beams.search_of(req_id) or req_id  # a beam fails its whole search
        self.to_front(RequestFailed(caller, ErrorCode.INTERNAL, message))
        self._abort(caller)

    def _abort(self, req_id: str) -> None:
        # False (nothing to do) once the request has ended.
        if not any(stage.abort(req_id) for stage in self.stages) and not self.beams.abort(req_id):
            self.engine.abort(req_id)

    def _admit(self, msg: StreamSubmit) -> None:
        if msg.imports_kv:  # no stage took it: this kind receives no KV
            raise NodeError(ErrorCode.FAILED_PRECONDITION, "this node receives no KV from prefill nodes")
        if not self.local_prefill:
            raise NodeError(ErrorCode.FAILED_PRECONDITION, "this node computes no prompts of its own "
                                                           "(a decode node takes them with --local-prefill)")
        new_tokens = len(msg.prompt_token_ids) + len(msg.resumed_token_ids)  # all of it is prefilled here
        self.bounds.check(len(self.engine.scheduler.waiting), queued_tokens(self.engine), new_tokens)
        try:
            if msg.beam is not None:
                self.beams.add(msg.req_id, msg.prompt_token_ids, beam_params(msg.beam, msg))
                return
            add_sample(self.engine, msg.req_id, msg.prompt_token_ids, msg.params, msg.sample_index,
                       msg.resumed_token_ids)
        except RequestRejected as exc:
            raise rejection_error(exc) from exc

    def after_step(self, outputs: list[EngineCoreOutput]) -> None:
        others, finished = self.beams.take(outputs)
        for stage in self.stages:
            others = stage.take(others)
        for out in others:
            self.stream(out, [out.new_token_id])
        for search in finished:
            self.to_front(beams_done(search))

    def stream(self, out: EngineCoreOutput, token_ids: list[int]) -> None:
        """An output's tokens to the front (none: token 1 was sampled elsewhere; only its finish,
        if any, goes out)."""
        reason = out.finish_reason
        if reason is None and not token_ids:
            return
        self.to_front(Tokens(out.req_id, token_ids, [Logprobs.of(out.logprobs)] if token_ids else [],
                             reason.value if reason is not None else None, out.stop_token_id,
                             PromptLogprobs.of(out.prompt_logprobs)))

    def poll(self, now: float) -> None:
        for stage in self.stages:
            stage.poll(now)

    def wants_fast_poll(self) -> bool:
        return any(stage.wants_fast_poll() for stage in self.stages)

    def num_blocks_outside_scheduler(self) -> int:
        return sum(stage.num_held_blocks() for stage in self.stages)


def make_node_core(config: NodeConfig, engine: EngineCore, to_front: ToFront, local_prefill: bool) -> NodeCore:
    """The node core as a node's flags set it up (its queue bounds), before its stages join."""
    return NodeCore(engine, to_front, QueueBounds(config.max_waiting_requests, config.max_queued_tokens), local_prefill)

"""The colocated node's part of the engine core: admit, run both phases, stream every token.

`make_handler` builds it in the engine-core process (the front names it in its `CorePart`,
colocated_node/server.py, with `uses_kv_transport=False`: nothing moves between nodes, so
the core starts no KV transport and the handler gets `None` for it). A request's life here:

    StreamSubmit ─▶ admit into the engine (prompt, plus resumed tokens on a resume; a sibling
        sample of a request still in its prefill is forked off it, node/sibling_forks.py)
        or RequestFailed at once:
          RESOURCE_EXHAUSTED — the queue bounds are full, or prompt + max_tokens need more
            KV blocks than this node has (another node may be bigger)
          INVALID_ARGUMENT   — anything else the engine refuses
    each step ─▶ Tokens{[token], [logprobs]} for tokens 1..n, the last with finish_reason
                 (token 1's with the prompt logprobs, when the params ask)
    Abort ─▶ abort the request in the engine (its blocks are freed at once)

A beam search (StreamSubmit.beam set) runs as `BeamSearches` (engine/beam_runner.py) beside
the ordinary requests: each step's outputs go through it first, and only the rest stream.
Its answer is one BeamsDone once the search ends; an Abort drops every beam it holds.

Must never: hold a block outside the scheduler, or answer a request twice.
"""

from __future__ import annotations

import logging

from pdserve.engine.admission import RequestRejected
from pdserve.engine.beam_runner import BeamSearches
from pdserve.engine.engine_core import EngineCore, EngineCoreOutput
from pdserve.node.config import NodeConfig
from pdserve.node.core_part import ToFront
from pdserve.node.errors import ErrorCode, NodeError, rejection_error
from pdserve.node.beam_searches import beam_params, beams_done
from pdserve.node.messages import Abort, Logprobs, Message, PromptLogprobs, RequestFailed, StreamSubmit, Tokens
from pdserve.node.sibling_forks import add_sample
from pdserve.node.stats import UNBOUNDED, QueueBounds, queued_tokens

logger = logging.getLogger(__name__)


class ColocatedCore:
    def __init__(self, engine: EngineCore, to_front: ToFront, bounds: QueueBounds = UNBOUNDED) -> None:
        self.engine = engine
        self.to_front = to_front
        self.bounds = bounds
        self.beams = BeamSearches(engine)

    def handle(self, msg: Message) -> None:
        if isinstance(msg, StreamSubmit):
            try:
                self._admit(msg)
            except NodeError as exc:
                self.to_front(RequestFailed(msg.req_id, exc.code, exc.message))
        elif isinstance(msg, Abort):
            # False (nothing to do) once the request has ended.
            if not self.beams.abort(msg.req_id):
                self.engine.abort(msg.req_id)
        else:
            logger.warning("colocated core ignores %s", type(msg).__name__)

    def fail(self, req_id: str, message: str) -> None:
        caller = self.beams.search_of(req_id) or req_id  # a beam fails its whole search
        self.to_front(RequestFailed(caller, ErrorCode.INTERNAL, message))
        self.handle(Abort(caller))

    def _admit(self, msg: StreamSubmit) -> None:
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
        for out in others:
            self._stream(out)
        for search in finished:
            self.to_front(beams_done(search))

    def poll(self, now: float) -> None:
        pass  # nothing outside the engine: no transfers, no leases

    def wants_fast_poll(self) -> bool:
        return False

    def num_blocks_outside_scheduler(self) -> int:
        return 0

    def _stream(self, out: EngineCoreOutput) -> None:
        reason = out.finish_reason
        self.to_front(Tokens(out.req_id, [out.new_token_id], [Logprobs.of(out.logprobs)],
                         reason.value if reason is not None else None, out.stop_token_id,
                         PromptLogprobs.of(out.prompt_logprobs)))


def make_handler(config: NodeConfig, engine: EngineCore, transport: None, descriptor: None,
                 to_front: ToFront) -> ColocatedCore:
    return ColocatedCore(engine, to_front, QueueBounds(config.max_waiting_requests, config.max_queued_tokens))

"""The colocated node's part of the engine core: admit, run both phases, stream every token.

`make_policy` / `make_handler` are the hooks the core process calls (node/core.py);
`CoreHooks(..., uses_kv_transport=False)` — nothing moves between nodes, so the core
starts no KV transport and the handler gets `None` for it. A request's life here:

    DecodeSubmit ─▶ admit into the engine (prompt, plus resumed tokens on a resume)
        or RequestFailed at once:
          RESOURCE_EXHAUSTED — the queue bounds are full, or prompt + max_tokens need more
            KV blocks than this node has (another node may be bigger)
          INVALID_ARGUMENT   — anything else the engine refuses
    each step ─▶ Tokens{[token], [logprobs]} for tokens 1..n, the last with finish_reason
    Abort ─▶ abort the request in the engine (its blocks are freed at once)

Must never: hold a block outside the scheduler, or answer a request twice.
"""

from __future__ import annotations

import logging

from pdserve.engine.engine_core import EngineCore, EngineCoreOutput, RequestRejected
from pdserve.engine.policy import ColocatedPolicy, SchedulingPolicy
from pdserve.engine.request import FinishReason, Request
from pdserve.node.config import NodeConfig
from pdserve.node.core_loop import Emit
from pdserve.node.errors import ErrorCode, NodeError
from pdserve.node.messages import Abort, DecodeSubmit, Logprobs, Message, RequestFailed, Tokens
from pdserve.node.stats import UNBOUNDED, QueueBounds, queued_tokens

logger = logging.getLogger(__name__)


class ColocatedCore:
    def __init__(self, engine: EngineCore, emit: Emit, bounds: QueueBounds = UNBOUNDED) -> None:
        self.engine = engine
        self.emit = emit
        self.bounds = bounds
        self._requests: dict[str, Request] = {}  # admitted and not yet finished

    def handle(self, msg: Message) -> None:
        if isinstance(msg, DecodeSubmit):
            try:
                self._admit(msg)
            except NodeError as exc:
                self.emit(RequestFailed(msg.req_id, exc.code, exc.message))
        elif isinstance(msg, Abort):
            if self._requests.pop(msg.req_id, None) is not None:
                self.engine.abort(msg.req_id)
        else:
            logger.warning("colocated core ignores %s", type(msg).__name__)

    def _admit(self, msg: DecodeSubmit) -> None:
        resumed = msg.resumed_token_ids
        self._check_capacity(msg)
        new_tokens = len(msg.prompt_token_ids) + len(resumed)  # all of it is prefilled here
        self.bounds.check(len(self.engine.scheduler.waiting), queued_tokens(self.engine), new_tokens)
        try:
            request = self.engine.add_request(msg.req_id, msg.prompt_token_ids, msg.params, msg.sample_index,
                                              resumed)
        except RequestRejected as exc:
            raise NodeError(ErrorCode.INVALID_ARGUMENT, str(exc)) from exc
        self._requests[msg.req_id] = request

    def _check_capacity(self, msg: DecodeSubmit) -> None:
        """A request whose KV can never fit this node's cache is this node's limit, not bad
        input: RESOURCE_EXHAUSTED, so the router tries a node with more blocks."""
        engine = self.engine
        tokens = min(len(msg.prompt_token_ids) + msg.params.max_tokens, engine.max_model_len)
        needed = engine.kv.blocks_needed(tokens)
        if needed > engine.num_blocks:
            raise NodeError(ErrorCode.RESOURCE_EXHAUSTED, f"prompt + max_tokens need {needed} KV blocks; "
                                                          f"this node has {engine.num_blocks}")

    def after_step(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            self._stream(out)

    def poll(self, now: float) -> None:
        pass  # nothing outside the engine: no transfers, no leases

    def wants_fast_poll(self) -> bool:
        return False

    def reserved_blocks(self) -> int:
        return 0

    def _stream(self, out: EngineCoreOutput) -> None:
        reason = out.finish_reason
        request = self._requests.pop(out.req_id, None) if reason is not None else self._requests.get(out.req_id)
        stop_token_id = request.stop_token_id if request is not None and reason is FinishReason.STOP else None
        self.emit(Tokens(out.req_id, [out.new_token_id], [Logprobs.of(out.logprobs)],
                         reason.value if reason is not None else None, stop_token_id))


def make_policy(config: NodeConfig) -> SchedulingPolicy:
    return ColocatedPolicy()


def make_handler(config: NodeConfig, engine: EngineCore, transport: None, descriptor: None,
                 emit: Emit) -> ColocatedCore:
    return ColocatedCore(engine, emit, QueueBounds(config.max_waiting_requests, config.max_queued_tokens))

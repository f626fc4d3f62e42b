"""One simulated node: the engine's own scheduler and KV cache manager, stepped on a simulated clock.

A `SimNode` builds exactly what an `EngineCore` builds for its config — the `KVCacheManager`,
the `Scheduler` with its prompt admission, chunk schedule and preemption policy
(`scheduler_for`, `chunk_schedule_for`), the node kind's `SchedulingPolicy` — but no model: a
step's duration comes from the profile's step-time model applied to the `SchedulerOutput` the
real scheduler produced, and its sampled token is a placeholder. So preemption, chunking, the
watermark, the KV budget and the hand-off at token 1 behave as the engine's do, and change when
they change. What it does after a step mirrors `EngineCore.step` / `_accept_token`: tokens counted
in (`update_after_step`), the stop rule (`token_finish_reason`), a finished request freed, a
request that hands off (a prefill node's, or one a decode node with --serve-prefill computes
for another) handed off with its blocks still held; `admit_prefilled` mirrors
`EngineCore.add_prefilled` on a decode node.

Must never: read a wall clock, sleep or load torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.block_pool import KVBlock
from pdserve.engine.chunk_schedule import CHUNK_ALIGN, chunk_schedule_for
from pdserve.engine.clock import Clock
from pdserve.engine.config import DEFAULT_KV_CACHE_BYTES, EngineConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.policy import SchedulingPolicy
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import SchedulerOutput, scheduler_for
from pdserve.engine.step_profile import StepTimeModel
from pdserve.engine.step_shape import StepShape
from pdserve.engine.stop_rules import token_finish_reason
from pdserve.engine.swap_space import SwapSpace, swap_blocks_for
from pdserve.planner.profile import Profile
from pdserve.router.cluster.placement import Candidate

PLACEHOLDER_TOKEN = 1  # what a simulated step "samples"; requests ignore eos, so it never stops one


class SimClock:
    """The simulation's time, moved only by the event loop."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


@dataclass(slots=True)
class Sampled:
    """A request reached its last token in the step that just ended."""

    request: Request
    finished: bool  # it ended here (freed)
    handoff_blocks: list[KVBlock] | None  # handed off at token 1 (a prefill node): still held
    computed_before: int  # tokens with KV before this step (its last chunk started there)
    pushes: int = 0  # handed off: the KV pushes it took, one per chunk (a prefill node's exporter's)


def num_blocks_for(config: EngineConfig, block_bytes: int) -> int:
    """The engine's KV capacity from an explicit count or bytes (pdserve/engine/kv_capacity.py's order);
    a fraction of memory is not simulated: the default bytes stand for it."""
    if config.num_blocks is not None:
        return config.num_blocks
    return (config.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES) // block_bytes


class SimNode:
    def __init__(self, node_id: str, config: EngineConfig, profile: Profile, policy: SchedulingPolicy,
                 clock: Clock, max_model_len: int) -> None:
        self.node_id = node_id
        self.config = config
        self.cost = profile.step
        self.policy = policy
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks_for(config, profile.kv_block_bytes), config.block_size,
                                 config.enable_prefix_caching)
        swap = SwapSpace(swap_blocks_for(config.swap_space_bytes, profile.kv_block_bytes))
        self.scheduler = scheduler_for(config, self.kv, swap, clock)
        self.scheduler.chunks = chunk_schedule_for(config, self._step_tokens_within_target)
        self.step: SchedulerOutput | None = None  # the step in progress
        self._arrivals = 0
        self._chunks: dict[str, int] = {}  # of each prompt in progress that is handed off at token 1

    def _step_tokens_within_target(self) -> int:
        """What `EngineCore._step_tokens_within_target` computes, from the profile's model of a
        single prefill chunk instead of timing one."""
        budget = self.config.max_num_batched_tokens
        shares = sorted({max(1, budget // 4), max(1, budget // 2), budget})
        model = StepTimeModel.fit([(n, self.cost.time(StepShape.of([(0, n)]))) for n in shares])
        return model.tokens_within(self.config.target_step_ms / 1e3, min(CHUNK_ALIGN, budget), budget)

    @property
    def num_blocks(self) -> int:
        return self.kv.pool.num_blocks

    @property
    def busy(self) -> bool:
        return self.step is not None

    def candidate(self, stats_seq: int) -> Candidate:
        """This node as the router's placement sees it, from fresh stats."""
        return Candidate(self.node_id, stats_seq, self.kv.num_free_blocks, self.scheduler.queued_prompt_tokens())

    def can_ever_hold(self, num_prompt_tokens: int, max_tokens: int) -> bool:
        """The engine's one capacity rule (`EngineCore._check_kv_fits`)."""
        return self.kv.blocks_needed(min(num_prompt_tokens + max_tokens, self.max_model_len)) <= self.num_blocks

    def new_request(self, req_id: str, prompt_token_ids: list[int], max_tokens: int,
                    hands_off: bool | None = None) -> Request:
        """`hands_off`: leaves at token 1, its KV held (None: as the node's policy says)."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        leaves = self.policy.hands_off_after_first_token() if hands_off is None else hands_off
        request = Request(req_id, list(prompt_token_ids), params, self._arrivals, seed=0, hands_off=leaves)
        self._arrivals += 1
        return request

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    def reserve(self, request: Request) -> bool:
        """A decode node's reservation for KV on its way (pdserve/decode_node/reservations.py)."""
        if self.kv.allocate_slots(request, request.num_tokens) is None:
            self.kv.free(request)
            return False
        return True

    def admit_prefilled(self, request: Request, first_token_id: int) -> bool:
        """The KV arrived with token 1 (`EngineCore.add_prefilled`); True when token 1 ends it."""
        request.num_computed_tokens = request.num_tokens
        self.kv.cache_computed_blocks(request)
        if self._accept_token(request, first_token_id):
            self.kv.free(request)
            return True
        self.scheduler.add(request)
        return False

    def start_step(self) -> float | None:
        """Schedule the next step; its profiled time on the node's own cores (the simulator's
        `StepTiming` turns it into time on the clock), or None when nothing can run now."""
        out = self.scheduler.schedule()
        while out.is_empty and out.preempted:  # the engine's loop steps again at once
            out = self.scheduler.schedule()
        if out.is_empty:
            return None
        self.step = out
        shape = StepShape.of((s.request.num_computed_tokens, s.num_scheduled_tokens) for s in out.scheduled)
        return self.cost.time(shape)

    def finish_step(self) -> list[Sampled]:
        out, self.step = self.step, None
        assert out is not None, "finish_step without a step in progress"
        sampling = [(s.request, s.request.num_computed_tokens) for s in out.scheduled if s.samples]
        # The exporter pushes a handed-off prompt's new full blocks after each of its chunks and
        # the rest at the end: one push a chunk (a chunk that fills no block makes none there;
        # a preempted prompt is pushed again from the start, its chunks counted again here).
        for s in out.scheduled:
            if s.request.hands_off:
                self._chunks[s.request.req_id] = self._chunks.get(s.request.req_id, 0) + 1
        self.scheduler.update_after_step(out)
        return [self._sampled(request, before) for request, before in sampling]

    def _sampled(self, request: Request, computed_before: int) -> Sampled:
        if request.hands_off:
            request.append_output_token(PLACEHOLDER_TOKEN)
            request.hand_off()
            self.scheduler.remove(request)
            return Sampled(request, False, self.kv.take_blocks(request), computed_before,
                           self._chunks.pop(request.req_id))
        finished = self._accept_token(request, PLACEHOLDER_TOKEN)
        if finished:
            self.scheduler.finish(request)
        return Sampled(request, finished, None, computed_before)

    def _accept_token(self, request: Request, token_id: int) -> bool:
        request.append_output_token(token_id)
        reason = token_finish_reason(token_id, request.num_output_tokens, request.num_tokens, request.params, (),
                                     self.max_model_len)
        if reason is not None:
            request.finish(reason)
        return reason is not None

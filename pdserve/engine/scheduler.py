"""The iteration-level scheduler: which requests run this step, and how many tokens each.

Lifecycle of a request through it:
  add() → waiting ─(blocks + budget)→ running ─(finished)→ finish(): removed, blocks freed
                 ↖──── preempted, recompute (blocks freed) ─────┤
                          swapped ◀── preempted, swap (KV to host blocks)
                             └─(device blocks free)→ running (KV copied back)
  remove() takes a request out of any queue and leaves its device blocks to the caller
  (a hand-off, or a request detached with its blocks still held); host blocks are freed.
Each step spends at most `max_num_batched_tokens` tokens on at most `max_num_seqs`
requests. A request that cannot get blocks preempts the latest arrival, so earlier requests
always make progress; whether the victim is recomputed or swapped out is the
`PreemptionPolicy`'s to say (pdserve/engine/preemption.py). Swapped requests come back, and waiting
ones are admitted, in arrival order across both queues (first come, first served: a swapped
request comes back before any prompt that arrived after it, as in vLLM v0), and never in a
step that preempted, so a step never both frees and takes a host block. When nothing runs and
the waiting or swapped head cannot get blocks, the latest waiting request holding blocks gives
them up (a decode node's prefilled requests wait holding their KV). When a new prompt may be
admitted (the watermark, the delay factor) is the `PromptAdmission`'s to say, and how long a
prompt's next chunk is the `ChunkSchedule`'s. The scheduler never runs the model.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.block_copies import BlockCopy, BlockPairs, CopyKind, copies_of, pairs_of
from pdserve.engine.chunk_schedule import ChunkSchedule, FixedChunks
from pdserve.engine.clock import Clock
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.preemption import PreemptionPolicy, RecomputePreemption, preemption_policy_for
from pdserve.engine.prompt_admission import PromptAdmission, watermark_blocks
from pdserve.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_scheduled_tokens: int

    @property
    def samples(self) -> bool:
        """Does this step reach the request's last token, whose logits give the next one?"""
        req = self.request
        return req.num_computed_tokens + self.num_scheduled_tokens == req.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # recomputed and swapped out alike
    # Every block copy of the step, in the order decided (pdserve/engine/block_copies.py): swap-outs, or
    # swap-ins (never both in one step), then copy-on-write; every rank makes them before its forward.
    copies: list[BlockCopy] = field(default_factory=list)

    @property
    def swap_out(self) -> BlockPairs:
        """(device block, host block) pairs of the step's swap-outs."""
        return pairs_of(self.copies, CopyKind.SWAP_OUT)

    @property
    def swap_in(self) -> BlockPairs:
        """(host block, device block) pairs of the step's swap-ins."""
        return pairs_of(self.copies, CopyKind.SWAP_IN)

    @property
    def block_copies(self) -> BlockPairs:
        """(src, dst) device blocks: forks about to write a shared block (copy-on-write)."""
        return pairs_of(self.copies, CopyKind.COW)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        admission: PromptAdmission | None = None,
        chunks: ChunkSchedule | None = None,
        preemption: PreemptionPolicy | None = None,
    ) -> None:
        self.kv = kv
        self.preemption = preemption or RecomputePreemption()
        self.swap = self.preemption.swap
        self.chunks = chunks or FixedChunks(max_num_batched_tokens)
        self.admission = admission or PromptAdmission()
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # kept in arrival order
        self.swapped: list[Request] = []  # kept in arrival order
        self.num_preemptions = 0  # recomputed and swapped out alike
        self.num_swaps_out = 0
        self.num_swaps_in = 0

    def add(self, request: Request) -> None:
        self.admission.arrived(request)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens not yet computed, waiting and running: what a new prompt waits behind
        (a request whose prompt came with its KV, as on a decode node, has none left)."""
        return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in (*self.waiting, *self.running))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.admission.start_step(self.waiting, bool(self.running))
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_queued(out, budget)
        assert not (out.swap_out and out.swap_in), "a step must not both free and take host blocks"
        # Last: the allocations of both passes above marked them (pdserve/engine/block_copies.py says why this order).
        out.copies.extend(copies_of(CopyKind.COW, self.kv.take_block_copies()))
        return out

    def update_after_step(self, out: SchedulerOutput) -> None:
        """The step ran: its tokens are now in the cache."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_scheduled_tokens
            self.kv.cache_computed_blocks(s.request)

    def finish(self, request: Request) -> None:
        """Remove a finished request from whichever queue holds it and free its blocks."""
        self.remove(request)
        self.kv.free(request)

    def holds(self, request: Request) -> bool:
        """Is the request in one of the queues (waiting, running or swapped)?"""
        return request in self.running or request in self.waiting or request in self.swapped

    def remove(self, request: Request) -> None:
        """Take a request out of whichever queue holds it (if any); its device blocks stay held,
        a swapped request's host blocks are freed (nobody else reads them), and with them its KV."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.swapped:
            self.swapped.remove(request)
            self.swap.release(request)
            request.num_computed_tokens = 0

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self.chunks.num_new_tokens(req, req.num_computed_tokens,
                                                 self.max_num_batched_tokens - budget, budget)
            if num_new == 0:  # the chunk schedule's step budget is spent; decodes behind it still fit
                i += 1
                continue
            if self.kv.allocate_slots(req, num_new) is None:
                victim = self.running[-1]  # the latest arrival
                self._preempt(victim, out)
                if victim is req:
                    break
                continue
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_queued(self, out: SchedulerOutput, budget: int) -> None:
        """Swapped and waiting requests join the running ones in arrival order across both queues
        (first come, first served), each with its next tokens in this step, until one cannot."""
        while budget > 0 and len(self.running) < self.max_num_seqs and (self.waiting or self.swapped):
            swapped_first = bool(self.swapped) and (
                not self.waiting or self.swapped[0].arrival_index < self.waiting[0].arrival_index)
            num_new = self._swap_in_head(out, budget) if swapped_first else self._admit_waiting_head(out, budget)
            if num_new == 0:
                return
            budget -= num_new

    def _admit_waiting_head(self, out: SchedulerOutput, budget: int) -> int:
        """Admit the waiting head; the tokens it runs this step, 0 when it cannot be admitted."""
        req = self.waiting[0]
        keep_free = self.admission.blocks_to_keep_free(req, bool(self.running))
        if keep_free is None:
            return 0  # held by the delay factor
        # A request still scoring its prompt (prompt_logprobs) needs the logits of every prompt
        # position, which a prefix-cache hit would skip computing: it takes no hit (as in vLLM).
        hit = self.kv.find_prefix_hit(req) if req.num_computed_tokens == 0 and not req.scores_prompt else None
        num_done = req.num_computed_tokens + (hit.num_tokens if hit else 0)
        num_new = self.chunks.num_new_tokens(req, num_done, self.max_num_batched_tokens - budget, budget)
        if num_new == 0:
            return 0
        if self.kv.allocate_slots(req, num_new, hit, keep_free) is None:
            if not self.running:
                self._preempt_waiting_holder(req, out)
            return 0
        self.admission.admitted(req)
        self.waiting.popleft()
        if hit:
            req.num_computed_tokens += hit.num_tokens
            # Prompt tokens only: after a preemption the hit may cover generated ones too.
            req.num_cached_tokens = max(req.num_cached_tokens, min(hit.num_tokens, req.num_prompt_tokens))
        self._run(req, num_new, out)
        return num_new

    def _swap_in_head(self, out: SchedulerOutput, budget: int) -> int:
        """Swap the earliest swapped request back in; the tokens it runs this step, 0 when the
        device pool has no room for it."""
        req = self.swapped[0]
        num_new = self.chunks.num_new_tokens(req, req.num_computed_tokens, self.max_num_batched_tokens - budget, budget)
        if num_new == 0:
            return 0
        # The watermark, as for a new prompt: a swap-in that forces a preemption next step thrashes.
        keep_free = self.admission.watermark_blocks if self.running else 0
        pairs = self.swap.swap_in(req, self.kv, num_new, keep_free)
        if pairs is None:
            if not self.running:
                self._preempt_waiting_holder(req, out)
            return 0
        self.swapped.pop(0)
        out.copies.extend(copies_of(CopyKind.SWAP_IN, pairs))
        self.num_swaps_in += 1
        self._run(req, num_new, out)
        return num_new

    def _run(self, req: Request, num_new: int, out: SchedulerOutput) -> None:
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=lambda r: r.arrival_index)
        out.scheduled.append(ScheduledRequest(req, num_new))

    def _preempt_waiting_holder(self, head: Request, out: SchedulerOutput) -> None:
        """Nothing runs, so no block will come free by itself, yet the head (waiting or swapped)
        cannot get its blocks: waiting requests hold them (a decode node's prefilled requests
        wait holding their prompt's KV). The latest of those gives its blocks up; the head is
        admitted next step."""
        holders = [r for r in self.waiting if r is not head and self.kv.block_ids(r.req_id)]
        if not holders:
            return  # the head alone cannot fit the pool: the engine's capacity check refuses that
        self._preempt(max(holders, key=lambda r: r.arrival_index), out)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Swap out or recompute a running request, or a waiting one holding blocks. A recomputed
        running victim waits at the front (it arrived before anything admitted after it); a
        waiting one keeps its place."""
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        was_running = victim in self.running
        if was_running:
            self.running.remove(victim)
        if self.preemption.swaps(victim, self.kv.blocks_needed(victim.num_computed_tokens)):
            if not was_running:
                self.waiting.remove(victim)
            out.copies.extend(copies_of(CopyKind.SWAP_OUT, self.swap.swap_out(victim, self.kv)))
            self.num_swaps_out += 1
            victim.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, victim, key=lambda r: r.arrival_index)
            return
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        if was_running:
            self.waiting.appendleft(victim)


def scheduler_for(config: EngineConfig, kv: KVCacheManager, swap: SwapSpace, clock: Clock | None = None) -> Scheduler:
    """The scheduler an engine with `config` runs over `kv`: the engine core's and the cluster
    simulator's (pdserve/planner/), so a simulated node schedules exactly as a real one. Its chunk schedule
    is the fixed one until the caller sets `chunks` (`chunk_schedule_for`: target-step needs the
    model's step times)."""
    admission = PromptAdmission(watermark_blocks(config.watermark, kv.pool.num_blocks), config.delay_factor, clock)
    return Scheduler(kv, config.max_num_batched_tokens, config.max_num_seqs, admission,
                     preemption=preemption_policy_for(config.preemption_mode, swap))

"""The iteration-level scheduler: which requests run this step, and how many tokens each.

Lifecycle of a request through it:
  add() → waiting ─(blocks + budget)→ running ─(finished)→ finish(): removed, blocks freed
                 ↖──── preempted (blocks freed, recompute later) ────┘
  remove() takes a request out of either queue and leaves its blocks to the caller
  (a hand-off, or a request detached with its blocks still held).
Each step spends at most `max_num_batched_tokens` tokens on at most `max_num_seqs`
requests. A request that cannot get blocks preempts the latest arrival (recompute),
so earlier requests always make progress; when nothing runs and the waiting head cannot
get blocks, the latest waiting request holding blocks gives them up (a decode node's
prefilled requests wait holding their KV). When a new prompt may be admitted (the watermark,
the delay factor) is the `PromptAdmission`'s to say, and how long a prompt's next chunk
is the `ChunkSchedule`'s. The scheduler never runs the model.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.chunk_schedule import ChunkSchedule, FixedChunks
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.prompt_admission import PromptAdmission
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
    preempted: list[Request] = field(default_factory=list)
    # (src, dst) blocks to copy before the forward: forks about to write a shared block.
    block_copies: list[tuple[int, int]] = field(default_factory=list)

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
    ) -> None:
        self.kv = kv
        self.chunks = chunks or FixedChunks(max_num_batched_tokens)
        self.admission = admission or PromptAdmission()
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # kept in arrival order
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.admission.arrived(request)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.admission.start_step(self.waiting, bool(self.running))
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.block_copies = self.kv.take_block_copies()
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

    def remove(self, request: Request) -> None:
        """Take a request out of whichever queue holds it (if any); its blocks stay held."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

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

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            keep_free = self.admission.blocks_to_keep_free(req, bool(self.running))
            if keep_free is None:
                break  # held by the delay factor
            # A request still scoring its prompt (prompt_logprobs) needs the logits of every prompt
            # position, which a prefix-cache hit would skip computing: it takes no hit (as in vLLM).
            hit = self.kv.find_prefix_hit(req) if req.num_computed_tokens == 0 and not req.scores_prompt else None
            num_done = req.num_computed_tokens + (hit.num_tokens if hit else 0)
            num_new = self.chunks.num_new_tokens(req, num_done, self.max_num_batched_tokens - budget, budget)
            if num_new == 0:
                break
            if self.kv.allocate_slots(req, num_new, hit, keep_free) is None:
                if not self.running:
                    self._preempt_waiting_holder(req, out)
                break
            self.admission.admitted(req)
            self.waiting.popleft()
            if hit:
                req.num_computed_tokens += hit.num_tokens
                # Prompt tokens only: after a preemption the hit may cover generated ones too.
                req.num_cached_tokens = max(req.num_cached_tokens, min(hit.num_tokens, req.num_prompt_tokens))
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=lambda r: r.arrival_index)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new

    def _preempt_waiting_holder(self, head: Request, out: SchedulerOutput) -> None:
        """Nothing runs, so no block will come free by itself, yet the head cannot get its
        blocks: waiting requests hold them (a decode node's prefilled requests wait holding
        their prompt's KV). The latest of those gives its blocks up (recompute later); the
        head is admitted next step."""
        holders = [r for r in self.waiting if r is not head and self.kv.block_ids(r.req_id)]
        if not holders:
            return  # the head alone cannot fit the pool: the engine's capacity check refuses that
        victim = max(holders, key=lambda r: r.arrival_index)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        out.preempted.append(victim)

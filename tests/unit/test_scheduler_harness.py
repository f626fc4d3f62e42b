"""The model-free engine loop the scheduler tests drive, the invariants it checks after
every step, and tests proving those checks catch what they are meant to catch.

`SchedLoop` wires a Scheduler, a KVCacheManager and a policy the way EngineCore does and
fakes only the model. Its step writes, for every scheduled token, a stand-in for that
token's KV into a shadow cache keyed by (block_id, offset): the token ids up to and
including it, which is what real KV depends on. The test picks the sampled tokens.
`check()` then proves, from public state: every request's blocks hold exactly its own
prefix for every computed token (so a prefix hit, an eviction or a preemption never
hands a request foreign KV), ref counts equal the number of holders, the free queue holds
exactly the unreferenced blocks, every cached block holds the prefix its hash names, and
the queues agree with the request states. Under swap preemption the step makes the swap
copies first (between the shadow cache and a shadow swap space), and a swapped request's
host blocks must hold exactly its own prefix too.

What differs between policies (which class, how the prefill policy hands blocks over)
sits in `colocated()` and `prefill()`, so renaming a policy is a one-line change here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pytest

from pdserve.engine.block_copies import CopyKind
from pdserve.engine.block_pool import KVBlock, hash_block_tokens
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.policy import ColocatedPolicy, SchedulingPolicy
from pdserve.engine.preemption import PreemptionPolicy
from pdserve.engine.prompt_admission import PromptAdmission
from pdserve.engine.request import FinishReason, Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.prefill_node.policy import PrefillPolicy

Handoff = list[tuple[Request, list[KVBlock]]]


@dataclass(slots=True)
class PolicySetup:
    policy: SchedulingPolicy


def colocated() -> PolicySetup:
    """Colocated (and decode) serving: blocks are freed when a request ends."""
    return PolicySetup(ColocatedPolicy())


def prefill() -> PolicySetup:
    """Prefill-only serving: a request is handed off at token 1, its blocks still held (to the exporter)."""
    return PolicySetup(PrefillPolicy())


def free_queue(kv: KVCacheManager) -> list[int]:
    """Free block ids in the order the pool hands them out next."""
    return kv.pool.free_order()


def ref_counts(kv: KVCacheManager, block_ids: Iterable[int]) -> list[int]:
    return [kv.pool.blocks[b].ref_count for b in block_ids]


Sample = Callable[[Request], int]


def always(token_id: int) -> Sample:
    return lambda request: token_id


class SchedLoop:
    def __init__(self, setup: PolicySetup, num_blocks: int = 16, block_size: int = 4, budget: int = 8,
                 max_seqs: int = 4, caching: bool = True, admission: PromptAdmission | None = None,
                 preemption: PreemptionPolicy | None = None) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        self.policy = setup.policy
        self._handed_over: Handoff = []  # handed off by the last step, blocks still referenced
        self.scheduler = Scheduler(self.kv, budget, max_seqs, admission, preemption=preemption)
        self.swap = self.scheduler.swap
        self.block_size = block_size
        self.kv_slots: dict[tuple[int, int], tuple[int, ...]] = {}  # (block_id, offset) -> prefix
        self.swap_slots: dict[tuple[int, int], tuple[int, ...]] = {}  # the same, of host blocks
        self.live: dict[str, Request] = {}  # added and not finished
        self.reserved: dict[str, Request] = {}  # live, holding blocks, KV not arrived yet
        # Without reservations every request joins the queue when it arrives, so all running
        # ones arrived before every waiting one; a KV import may join later than it arrived.
        self._joined_in_arrival_order = True
        self.exports: dict[str, tuple[Request, list[KVBlock]]] = {}  # handed over, not yet freed
        self.finished: list[Request] = []  # ended by their last token, in order
        self.aborted: list[Request] = []
        self._arrivals = 0

    # -- what the node above the scheduler does ------------------------------------------

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 16, prompt_logprobs: int | None = None) -> Request:
        request = self._new_request(req_id, prompt, max_tokens, prompt_logprobs)
        self.scheduler.add(request)
        self.check()
        return request

    def reserve(self, req_id: str, prompt: list[int], max_tokens: int = 16) -> Request:
        """A decode node's reservation: the request holds blocks for its prompt, whose KV
        has not arrived, and is in neither queue (as ReservationTable.reserve)."""
        request = self._new_request(req_id, prompt, max_tokens)
        assert self.kv.allocate_slots(request, request.num_tokens) is not None, "no blocks to reserve"
        self.reserved[req_id] = request
        self._joined_in_arrival_order = False
        self.check()
        return request

    def arrive(self, req_id: str, first_token: int = 7) -> Request:
        """The reserved request's KV and token 1 arrive: imported, published, scheduled
        (as EngineCore.add_prefilled)."""
        request = self.reserved.pop(req_id)
        self._write_kv(request, request.num_tokens)
        request.num_computed_tokens = request.num_tokens
        self.kv.cache_computed_blocks(request)
        request.append_output_token(first_token)
        self.scheduler.add(request)
        self.check()
        return request

    def abort(self, req_id: str) -> None:
        request = self.live.pop(req_id)
        request.finish(FinishReason.ABORT)
        if self.policy.hands_off_after_first_token():
            # A prefill node's exporter detaches an aborted request: its blocks, still held,
            # are freed once no push reads them (EngineCore.detach).
            self.scheduler.remove(request)
            self._handed_over.append((request, self.kv.take_blocks(request)))
        else:
            self.scheduler.finish(request)
        self.aborted.append(request)
        self._collect_handed_over()
        self.check()

    def free_exports(self, req_ids: Iterable[str] | None = None) -> None:
        """The exporter is done with these requests' blocks (all of them by default)."""
        for req_id in list(self.exports if req_ids is None else req_ids):
            _, blocks = self.exports.pop(req_id)
            self.kv.pool.free(reversed(blocks))
        self.check()

    def step(self, sample: Sample = always(7)) -> SchedulerOutput:
        sched = self.scheduler
        before = list(sched.running), list(sched.waiting), list(sched.swapped)
        out = sched.schedule()
        self._check_output(out, *before)
        self._copy_swapped(out)
        samplers = [s.request for s in out.scheduled if s.samples]
        for s in out.scheduled:
            self._write_kv(s.request, s.num_scheduled_tokens)
        self.scheduler.update_after_step(out)
        for request in samplers:
            self._accept(request, sample(request))
        self._collect_handed_over()
        self.check()
        return out

    def run_to_completion(self, max_steps: int = 1000) -> None:
        """Step until every request ends, the exporter finishing every push at once. Fails at
        a step that can change nothing: no request scheduled or preempted, and no reservation
        whose arrival could (nothing outside the scheduler will ever move it again)."""
        self.free_exports()
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            out = self.step()
            self.free_exports()
            stuck = not out.scheduled and not out.preempted and not self.reserved
            assert not stuck, (f"deadlock: waiting {[r.req_id for r in self.scheduler.waiting]}, "
                               f"{self.kv.num_free_blocks} blocks free")
        raise AssertionError(f"unfinished after {max_steps} steps")

    def step_ids(self, sample: Sample = always(7)) -> list[tuple[str, int]]:
        """One step; what it scheduled as (req_id, num_scheduled_tokens), in batch order."""
        return [(s.request.req_id, s.num_scheduled_tokens) for s in self.step(sample).scheduled]

    def held(self, req_id: str) -> list[int]:
        return self.kv.block_ids(req_id)

    def _new_request(self, req_id: str, prompt: list[int], max_tokens: int,
                     prompt_logprobs: int | None = None) -> Request:
        params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
        request = Request(req_id, list(prompt), params, self._arrivals, seed=0)
        self._arrivals += 1
        self.live[req_id] = request
        return request

    def _accept(self, request: Request, token_id: int) -> None:
        """What the engine core does with a sampled token (pdserve/engine/engine_core.py)."""
        request.append_output_token(token_id)
        if self.policy.hands_off_after_first_token():
            request.hand_off()
            self.scheduler.remove(request)
            self._handed_over.append((request, self.kv.take_blocks(request)))
        elif request.num_output_tokens >= request.params.max_tokens:
            request.finish(FinishReason.LENGTH)
            self.scheduler.finish(request)
        else:
            return
        del self.live[request.req_id]
        self.finished.append(request)

    def _collect_handed_over(self) -> None:
        handed_over, self._handed_over = self._handed_over, []
        for request, blocks in handed_over:
            assert request.req_id not in self.exports
            self.exports[request.req_id] = (request, blocks)

    def _copy_swapped(self, out: SchedulerOutput) -> None:
        """The model runner's block copies, in the step's order, before the forward (pdserve/engine/model_runner.py)."""
        ends = {CopyKind.SWAP_OUT: (self.kv_slots, self.swap_slots), CopyKind.SWAP_IN: (self.swap_slots, self.kv_slots),
                CopyKind.COW: (self.kv_slots, self.kv_slots)}
        for copy in out.copies:
            src, dst = ends[copy.kind]
            for offset in range(self.block_size):
                prefix = src.get((copy.src, offset))
                if prefix is None:
                    dst.pop((copy.dst, offset), None)
                else:
                    dst[copy.dst, offset] = prefix

    def _write_kv(self, request: Request, num_tokens: int) -> None:
        """The fake model: the KV of `num_tokens` tokens after the computed ones."""
        ids, size = self.held(request.req_id), self.block_size
        for pos in range(request.num_computed_tokens, request.num_computed_tokens + num_tokens):
            block = self.kv.pool.blocks[ids[pos // size]]
            # A block another holder reads (a prefix hit, an export) must never be written.
            assert block.ref_count == 1, f"{request.req_id} writes block {block.block_id} held {block.ref_count}x"
            assert block.block_hash is None, f"{request.req_id} writes cached block {block.block_id}"
            self.kv_slots[block.block_id, pos % size] = tuple(request.token_ids[: pos + 1])

    # -- invariants -------------------------------------------------------------------------

    def _check_output(self, out: SchedulerOutput, running_before: list[Request],
                      waiting_before: list[Request], swapped_before: list[Request]) -> None:
        sched = self.scheduler
        scheduled = [s.request for s in out.scheduled]
        assert len(set(map(id, scheduled))) == len(scheduled), "a request scheduled twice"
        assert all(s.num_scheduled_tokens >= 1 for s in out.scheduled)
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        assert not any(r in scheduled for r in out.preempted), "a victim was scheduled this step"
        # Running requests first, in arrival order; then swapped ones back in and admissions from
        # the head of the waiting queue, each in its queue's order, and the two interleaved in
        # arrival order (first come, first served: nobody overtakes).
        num_old = sum(1 for r in scheduled if r in running_before)
        assert all(r in running_before for r in scheduled[:num_old])
        assert [r.arrival_index for r in scheduled[:num_old]] == sorted(r.arrival_index for r in scheduled[:num_old])
        joined = scheduled[num_old:]
        back = [r for r in joined if r in swapped_before]
        admitted = [r for r in joined if r not in swapped_before]
        assert back == swapped_before[: len(back)]
        assert admitted == waiting_before[: len(admitted)]
        assert [r.arrival_index for r in joined] == sorted(r.arrival_index for r in joined)
        assert not (out.swap_out and out.swap_in), "a step both swapped out and in"
        if out.preempted:
            assert num_old == len(scheduled), "a waiting request was admitted in a step that preempted"
        for s in out.scheduled:
            needed = self.kv.blocks_needed(s.request.num_computed_tokens + s.num_scheduled_tokens)
            assert len(self.held(s.request.req_id)) == needed

    def check(self) -> None:
        self._check_queues()
        holders: dict[int, int] = {}
        for request, ids in self._holdings():
            assert len(ids) == self.kv.blocks_needed(request.num_computed_tokens), request.req_id
            for pos in range(request.num_computed_tokens):
                slot = (ids[pos // self.block_size], pos % self.block_size)
                assert self.kv_slots.get(slot) == tuple(request.token_ids[: pos + 1]), f"{request.req_id} @ {pos}"
            for block_id in ids:
                holders[block_id] = holders.get(block_id, 0) + 1
        for request in self.reserved.values():
            for block_id in self.held(request.req_id):
                holders[block_id] = holders.get(block_id, 0) + 1
        self._check_swapped()
        blocks = self.kv.pool.blocks
        assert [b.ref_count for b in blocks] == [holders.get(b.block_id, 0) for b in blocks]
        assert sorted(free_queue(self.kv)) == [b.block_id for b in blocks if b.ref_count == 0]
        assert self.kv.num_free_blocks == len(free_queue(self.kv))
        for block in blocks:
            self._check_cached(block)

    def _check_swapped(self) -> None:
        """Swapped requests hold no device block, and host blocks with exactly their own prefix."""
        host_holders: list[int] = []
        for request in self.scheduler.swapped:
            assert self.held(request.req_id) == [], f"swapped {request.req_id} holds device blocks"
            ids = self.swap.block_ids(request.req_id)
            assert len(ids) == self.kv.blocks_needed(request.num_computed_tokens), request.req_id
            for pos in range(request.num_computed_tokens):
                slot = (ids[pos // self.block_size], pos % self.block_size)
                assert self.swap_slots.get(slot) == tuple(request.token_ids[: pos + 1]), f"{request.req_id} @ {pos}"
            host_holders.extend(ids)
        assert len(set(host_holders)) == len(host_holders), "a host block held twice"
        assert self.swap.num_used_blocks == len(host_holders), "a host block leaked"

    def _holdings(self) -> list[tuple[Request, list[int]]]:
        """Who holds which blocks, reservations left out (their blocks have no KV yet)."""
        held = [(r, self.held(r.req_id)) for r in self.live.values()
                if r.req_id not in self.reserved and r.status is not RequestStatus.SWAPPED]
        return held + [(r, [b.block_id for b in blocks]) for r, blocks in self.exports.values()]

    def _check_queues(self) -> None:
        sched = self.scheduler
        running, waiting, swapped = sched.running, list(sched.waiting), sched.swapped
        scheduled = [r for r in self.live.values() if r.req_id not in self.reserved]
        assert sorted(map(id, running + waiting + swapped)) == sorted(map(id, scheduled))
        assert all(r.status is RequestStatus.RUNNING for r in running)
        assert all(r.status is RequestStatus.WAITING for r in waiting)
        assert all(r.status is RequestStatus.SWAPPED for r in swapped)
        assert [r.arrival_index for r in swapped] == sorted(r.arrival_index for r in swapped)
        assert [r.arrival_index for r in running] == sorted(r.arrival_index for r in running)
        assert len(running) <= sched.max_num_seqs
        assert sched.has_unfinished() == bool(scheduled)
        if self._joined_in_arrival_order and running and waiting:
            assert max(r.arrival_index for r in running) < min(r.arrival_index for r in waiting)

    def _check_cached(self, block: KVBlock) -> None:
        """A cached block holds a full block of the very prefix its hash names."""
        if block.block_hash is None:
            return
        size = self.block_size
        prefix = self.kv_slots.get((block.block_id, size - 1))
        assert prefix is not None and len(prefix) % size == 0, f"block {block.block_id} cached before computed"
        for offset in range(size):
            assert self.kv_slots.get((block.block_id, offset)) == prefix[: len(prefix) - size + offset + 1]
        block_hash = None
        for start in range(0, len(prefix), size):
            block_hash = hash_block_tokens(block_hash, prefix[start : start + size])
        assert block.block_hash == block_hash, f"block {block.block_id} cached under a foreign hash"


# -- the checks can fail -------------------------------------------------------------------


def test_check_catches_a_block_whose_kv_is_not_the_requests_own():
    loop = SchedLoop(colocated())
    loop.add("a", [1, 2, 3, 4, 5])
    loop.step()
    loop.kv_slots[loop.held("a")[0], 2] = (9, 9, 9)  # as if another request had written there
    with pytest.raises(AssertionError, match="a @ 2"):
        loop.check()


def test_check_catches_a_leaked_reference():
    loop = SchedLoop(colocated())
    loop.add("a", [1, 2, 3])
    loop.step()
    loop.kv.pool.touch([loop.kv.pool.blocks[5]])  # a reference nobody owns
    with pytest.raises(AssertionError):
        loop.check()


def test_check_catches_a_block_cached_under_a_foreign_hash():
    loop = SchedLoop(colocated())
    loop.add("a", [1, 2, 3, 4, 5])
    loop.step()
    loop.kv.pool.blocks[0].block_hash = hash_block_tokens(None, [4, 3, 2, 1])
    with pytest.raises(AssertionError, match="foreign hash"):
        loop.check()


def test_fake_model_refuses_to_write_into_a_shared_block():
    loop = SchedLoop(colocated())
    request = loop.add("a", [1, 2, 3])
    loop.kv.allocate_slots(request, 3)
    loop.kv.pool.touch([loop.kv.pool.blocks[0]])  # block 0 now also read by someone else
    with pytest.raises(AssertionError, match="held 2x"):
        loop._write_kv(request, 3)

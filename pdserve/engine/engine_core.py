"""The engine core: one step is schedule → run → update.

Owns the scheduler, the KV cache manager and the model runner of one node, and the
node kind's `SchedulingPolicy`. Token-level stopping (eos, stop token ids, max_tokens,
the model's length) happens here; text-level stopping (stop strings) belongs to whoever
detokenizes, which then calls `abort`.

Every sampled token becomes one `EngineCoreOutput`. A request leaves the engine through
one of them — finished (`finish_reason`, and `stop_token_id` when a stop token ended it)
or, when it hands off (`Request.hands_off`: every request under a prefill node's policy, and a
prompt a decode node with --serve-prefill computes for another), at its first token with
its blocks still held (`handoff_blocks`) — or through `abort` (blocks freed) or
`detach` (blocks returned to the caller, still held).

`fork` starts a request that shares another's computed prefix by reference (its blocks are
copied only on write, pdserve/engine/kv_cache_manager.py): the n samples of one prompt fork from
sample 0's first step (`pending_forks`), and beam search (pdserve/engine/beam_search.py) forks beams.
`add_fork` attaches a sample that arrives later (a node's sibling sample) while the request it
forks from has not sampled yet; a request aborted or detached with samples still pending leaves
them in the engine as requests of their own (promoted), so none is lost.
`pause` / `resume` hold a request out of the scheduler, blocks kept, between two of its tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.admission import KVCapacityExceeded, RequestRejected
from pdserve.engine.block_pool import KVBlock
from pdserve.engine.chunk_schedule import CHUNK_ALIGN, chunk_schedule_for
from pdserve.engine.clock import MonotonicClock
from pdserve.engine.config import EngineConfig
from pdserve.engine.first_steps import check_first_steps
from pdserve.engine.grammar import GrammarCompiler, GrammarGate, RequestGrammar
from pdserve.engine.kv_budget import max_concurrency
from pdserve.engine.kv_capacity import num_kv_blocks
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.model_loader import LoadedModel, load_model
from pdserve.engine.model_runner import ModelRunner, PromptScores, SampledToken, kv_block_bytes
from pdserve.engine.parallel import StepFanout
from pdserve.engine.policy import ColocatedPolicy, SchedulingPolicy
from pdserve.engine.prompt_logprobs import PromptLogprobs
from pdserve.engine.request import FinishReason, PendingFork, Request
from pdserve.engine.sampler import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import scheduler_for
from pdserve.engine.step_profile import StepTimeModel, profile_step_times
from pdserve.engine.step_shape import StepShape, StepTotals
from pdserve.engine.stop_rules import token_finish_reason
from pdserve.engine.swap_space import SwapSpace, swap_blocks_for

logger = logging.getLogger(__name__)

# How long a step with nothing else to run waits for a grammar to compile before it returns.
GRAMMAR_WAIT_S = 0.01


@dataclass(slots=True)
class EngineCoreOutput:
    req_id: str
    new_token_id: int
    logprobs: TokenLogprobs | None
    # Set once the request ended here; never for a hand-off (the request goes on elsewhere).
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    # The entry of the request's stop_token_ids that ended it (finish_reason STOP), if one did.
    stop_token_id: int | None = None
    # Handed off after this token: the request's blocks in position order, still referenced.
    # The receiver owns them now and frees them with `kv.pool.free` once nothing reads them.
    handoff_blocks: list[KVBlock] | None = None
    # On the first token this engine samples for a request that asked for prompt logprobs:
    # every prompt token after the first, scored (pdserve/engine/prompt_logprobs.py).
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def is_last(self) -> bool:
        """Is this the request's last output here (it finished, or was handed off)?"""
        return self.finish_reason is not None or self.handoff_blocks is not None


class StepFailed(Exception):
    """The model raised during a step: `req_ids` were in it and cannot go on. The engine stays
    usable (the caller aborts them, which frees their blocks; nothing else changed: the step's
    tokens were never recorded). Raised only on a single rank: with tensor-parallel workers in
    the middle of the same step, the original exception ends the node."""

    def __init__(self, req_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.req_ids = req_ids


def _record_prompt_scores(scores: PromptScores) -> None:
    collected = scores.request.prompt_logprobs
    assert collected is not None, "the runner scores only requests that collect prompt logprobs"
    collected.extend(scores.token_ids, scores.logprobs)


class EngineCore:
    def __init__(self, config: EngineConfig, policy: SchedulingPolicy | None = None, loaded: LoadedModel | None = None,
                 fanout: StepFanout | None = None):
        """`loaded`: a model already loaded (tests share one; a tensor-parallel node loads rank 0's
        slice first); `fanout`: hands every step, its block copies with it, to the node's other
        ranks (pdserve/ranks/tp_group.py)."""
        # Resolved once, here, so every reader (KV cache, fingerprint, logs) sees the same dtype.
        config = config.resolved()
        if config.tensor_parallel_size > 1 and fanout is None:
            raise ValueError("tensor_parallel_size > 1 runs on several processes: start the engine with "
                             "pdserve.ranks.tp_group.start_engine (what LLM and every node do)")
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.loaded = loaded or load_model(config.model, config.torch_dtype, config.model_impl,
                                           device=config.torch_device)
        if self.loaded.device != config.torch_device:
            raise ValueError(f"device {config.device}: the model given was loaded on {self.loaded.device}")
        self.max_model_len = min(config.max_model_len or self.loaded.max_model_len, self.loaded.max_model_len)
        num_blocks = num_kv_blocks(config, self.loaded, self.max_model_len)
        logger.info("KV cache: %d blocks of %d tokens (%d MiB); %.2f requests of the model's %d tokens at once",
                    num_blocks, config.block_size,
                    num_blocks * kv_block_bytes(self.loaded, config.block_size, config.torch_dtype) >> 20,
                    max_concurrency(num_blocks, config.block_size, self.max_model_len), self.max_model_len)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.swap = SwapSpace(self._num_swap_blocks())
        self.policy = policy or ColocatedPolicy()
        self.scheduler = scheduler_for(config, self.kv, self.swap)
        self.runner = ModelRunner(self.loaded, self.kv, num_blocks, config.torch_dtype, config.attention_backend,
                                  fanout, self.swap.num_blocks)
        self._requests: dict[str, Request] = {}
        self.grammars = GrammarGate(lambda: GrammarCompiler(self.loaded.tokenizer, self.loaded.vocab_size,
                                                            self.loaded.eos_token_ids))
        self._seeds = random.Random(config.seed)
        self._arrivals = 0
        self._fork_parents: dict[str, str] = {}  # a pending fork's req_id -> the request it forks from
        self.num_forked_samples = 0  # samples forked off another's first logits (`pending_forks`)
        self.step_totals = StepTotals()  # every step's shape and the seconds its forward took
        self.num_failed_requests = 0  # requests in a step that raised (StepFailed)
        if fanout is None:
            self.finish_start()

    def finish_start(self) -> None:
        """The part of starting that runs steps: the first steps that prove the model runs here
        (pdserve/engine/first_steps.py), then the chunk schedule (target-step times the model).
        A tensor-parallel node calls it once every rank has its caches (pdserve/ranks/tp_group.py)."""
        check_first_steps(self.runner, self.config.model)
        self.scheduler.chunks = chunk_schedule_for(self.config, self._step_tokens_within_target)

    def _step_tokens_within_target(self) -> int:
        budget = self.config.max_num_batched_tokens
        model = StepTimeModel.fit(profile_step_times(self.runner.execute, self.kv, budget, MonotonicClock()))
        tokens = model.tokens_within(self.config.target_step_ms / 1e3, min(CHUNK_ALIGN, budget), budget)
        logger.info("target-step schedule: step ≈ %.1f ms + %.3f ms/token, so %d tokens a step for %.0f ms",
                    model.base_s * 1e3, model.per_token_s * 1e3, tokens, self.config.target_step_ms)
        return tokens

    def _num_swap_blocks(self) -> int:
        block_bytes = kv_block_bytes(self.loaded, self.config.block_size, self.config.torch_dtype)
        num_swap_blocks = swap_blocks_for(self.config.swap_space_bytes, block_bytes)
        if self.config.preemption_mode == "swap" and num_swap_blocks == 0:
            raise ValueError(f"preemption_mode swap: --swap-space-bytes {self.config.swap_space_bytes} holds no "
                             f"block of {block_bytes} bytes")
        if num_swap_blocks:
            logger.info("swap space: %d blocks (%d MiB), --preemption-mode %s", num_swap_blocks,
                        num_swap_blocks * block_bytes >> 20, self.config.preemption_mode)
        return num_swap_blocks

    @property
    def num_blocks(self) -> int:
        return self.kv.pool.num_blocks

    def request(self, req_id: str) -> Request | None:
        """The request under `req_id` while this engine holds it (a pending fork is not one yet)."""
        return self._requests.get(req_id)

    def add_request(
        self, req_id: str, prompt_token_ids: list[int], params: SamplingParams, sample_index: int = 0,
        resumed_token_ids: Sequence[int] = (), forks: Sequence[PendingFork] = (), hands_off: bool | None = None,
    ) -> Request:
        """`forks`: further samples of the same prompt, drawn from this request's first logits
        and forked off it then, sharing the prompt's blocks (each output under its own req_id).
        `hands_off`: does it leave at its first token, its KV held (None: as the policy says)?"""
        request = self.new_request(req_id, prompt_token_ids, params, sample_index, resumed_token_ids)
        if hands_off is not None:
            request.hands_off = hands_off
        ids = [req_id, *(f.req_id for f in forks)]
        taken = next((i for i in ids[1:] if self._is_taken(i) or ids.count(i) > 1), None)
        if taken is not None:
            del self._requests[req_id]
            raise RequestRejected(f"req_id {taken!r} is already in use")
        request.pending_forks = list(forks)
        self._fork_parents.update((f.req_id, req_id) for f in forks)
        self._schedule(request)
        return request

    def add_fork(self, parent_id: str, fork: PendingFork) -> bool:
        """Draw `fork`'s first token from the parent's first logits and fork it off then, sharing
        every prompt block (its partial last one included). False, nothing changed, when too late:
        the parent is gone, is not scheduled here, or has sampled. The caller has checked that the
        two are samples of one prompt with the same params; the child runs with the parent's."""
        if self._is_taken(fork.req_id):
            raise RequestRejected(f"req_id {fork.req_id!r} is already in use")
        parent = self._requests.get(parent_id)
        if parent is None or parent.num_output_tokens or not self.scheduler.holds(parent):
            return False
        parent.pending_forks.append(fork)
        self._fork_parents[fork.req_id] = parent_id
        return True

    def _is_taken(self, req_id: str) -> bool:
        return req_id in self._requests or req_id in self._fork_parents

    def _drop_pending_fork(self, child_id: str) -> bool:
        parent_id = self._fork_parents.pop(child_id, None)
        if parent_id is None:
            return False
        parent = self._requests[parent_id]
        parent.pending_forks = [f for f in parent.pending_forks if f.req_id != child_id]
        return True

    def _promote_pending_forks(self, parent: Request) -> None:
        """The parent leaves before its first token: each pending sample becomes a request of its
        own, computing the prompt itself (with the parent's seed, so the same draws)."""
        params = dataclasses.replace(parent.params, prompt_logprobs=None)  # scored by the parent only
        for fork in parent.pending_forks:
            del self._fork_parents[fork.req_id]
            child = Request(fork.req_id, parent.prompt_token_ids, params, self._arrivals, parent.seed,
                            fork.sample_index, hands_off=parent.hands_off)
            self._arrivals += 1
            self._requests[fork.req_id] = child
            self._schedule(child)
        parent.pending_forks = []

    def fork(self, parent_id: str, child_id: str, token_id: int, logprobs: TokenLogprobs | None = None,
             sample_index: int | None = None) -> EngineCoreOutput:
        """A new request: the parent's computed tokens, then `token_id` as its latest output.

        The child references the parent's blocks (no copy until one of them writes a shared
        block) and joins the scheduler unless `token_id` ends it; the output is `token_id`'s,
        stop rules applied. The parent must have computed its prompt and is left unchanged
        (its own uncomputed latest token, if any, is not the child's).
        """
        parent = self._requests.get(parent_id)
        if parent is None:
            raise KeyError(f"unknown request {parent_id!r}")
        if child_id in self._requests:
            raise RequestRejected(f"req_id {child_id!r} is already in use")
        if parent.num_computed_tokens < parent.num_prompt_tokens:
            raise ValueError(f"request {parent_id!r} has not computed its prompt yet: nothing to share")
        computed = parent.token_ids[: parent.num_computed_tokens]
        child = Request(child_id, parent.prompt_token_ids, parent.params, self._arrivals, parent.seed,
                        parent.sample_index if sample_index is None else sample_index, token_ids=list(computed),
                        output_token_ids=computed[parent.num_prompt_tokens:],
                        num_computed_tokens=parent.num_computed_tokens, num_cached_tokens=parent.num_cached_tokens,
                        hands_off=parent.hands_off)
        child.prompt_logprobs = None  # a prompt is scored once, by the request that computed it
        if parent.grammar is not None:
            child.grammar = RequestGrammar.start(parent.grammar.compiled, child.output_token_ids)
        self._arrivals += 1
        self._requests[child_id] = child
        self.kv.fork(parent, child)
        out = self._accept_token(child, token_id, logprobs)
        if not out.is_last:
            self._schedule(child)
        return out

    def pause(self, req_id: str) -> None:
        """Hold a request out of the scheduler, its blocks kept, until `resume` (or `abort`)."""
        request = self._requests.get(req_id)
        if request is None:
            raise KeyError(f"unknown request {req_id!r}")
        self.scheduler.remove(request)
        self.grammars.release(request)

    def resume(self, req_id: str) -> None:
        self._schedule(self._check_unscheduled(req_id))

    def _schedule(self, request: Request) -> None:
        """Into the scheduler, or, while its grammar compiles, into the grammar gate (`step` moves it on)."""
        if self.grammars.attach_if_ready(request):
            self.scheduler.add(request)
        else:
            self.grammars.hold(request)

    def new_request(
        self, req_id: str, prompt_token_ids: list[int], params: SamplingParams, sample_index: int = 0,
        resumed_token_ids: Sequence[int] = (),
    ) -> Request:
        """Validate and register a request without scheduling it.

        A decode node reserves blocks for it (`kv.allocate_slots`) and schedules it with
        `add_prefilled` once its prompt KV has arrived, or gives it up with `detach`.

        `resumed_token_ids`: tokens this sample already generated on a node that failed.
        They are output (max_tokens, min_tokens, penalties, stop rules and the seeded
        draw's position all count them) whose KV is computed like the prompt's, so the
        request goes on exactly where the failed node left off.
        """
        self._validate(req_id, prompt_token_ids, params, resumed_token_ids)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        request = Request(req_id, list(prompt_token_ids), params, self._arrivals, seed, sample_index,
                          token_ids=[*prompt_token_ids, *resumed_token_ids],
                          output_token_ids=list(resumed_token_ids),
                          hands_off=self.policy.hands_off_after_first_token())
        self._arrivals += 1
        self._requests[req_id] = request
        self.grammars.start(request)  # compiles while the request waits (a decode node: for its KV)
        return request

    def add_prefilled(self, request: Request, first_token_id: int) -> EngineCoreOutput:
        """Schedule a `new_request` whose prompt KV is already in its blocks, with token 1.

        Token 1 was sampled elsewhere (a prefill node); the token-level stop checks run on
        it here, exactly as if this engine had sampled it. When it ends the request, the
        output says so and the blocks are released; otherwise the request joins the
        scheduler and decodes from token 2. (A resumed request: "prompt" is prompt +
        resumed tokens, and "token 1" the first token after them.)
        """
        self._check_unscheduled(request.req_id)
        request.num_computed_tokens = request.num_tokens
        self.kv.cache_computed_blocks(request)
        # The prompt was computed (and scored, if asked) where token 1 was sampled, which answers
        # its logprobs; a recompute here after a preemption must not score it again.
        request.prompt_logprobs = None
        self.grammars.attach_if_ready(request)  # when compiled already, token 1 advances the matcher below
        out = self._accept_token(request, first_token_id, None)
        if not out.is_last:
            self._schedule(request)
        return out

    def detach(self, req_id: str) -> list[KVBlock]:
        """Forget a request, scheduled or not; its blocks go to the caller, still held.

        The caller frees them with `kv.pool.free` once nothing can touch them any more: a
        decode node's reserved blocks may still be receiving a prefill's KV, an aborted
        prefill's blocks may still be read by its pushes.
        """
        if self._drop_pending_fork(req_id):
            return []  # a pending fork holds no block of its own yet
        request = self._requests.get(req_id)
        if request is None:
            raise KeyError(f"unknown request {req_id!r}")
        self._promote_pending_forks(request)
        request.finish(FinishReason.ABORT)
        return self._leave(request)

    def _check_unscheduled(self, req_id: str) -> Request:
        request = self._requests.get(req_id)
        if request is None:
            raise KeyError(f"unknown request {req_id!r}")
        if self.scheduler.holds(request):
            raise ValueError(f"request {req_id!r} is already scheduled")
        return request

    def abort(self, req_id: str) -> bool:
        """False once the request has ended. A pending fork is dropped from its parent's forks."""
        if self._drop_pending_fork(req_id):
            return True
        request = self._requests.pop(req_id, None)
        if request is None:
            return False
        self._promote_pending_forks(request)
        request.finish(FinishReason.ABORT)
        self.grammars.remove(request)
        self.scheduler.finish(request)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or len(self.grammars) > 0

    def _admit_compiled(self) -> None:
        """Schedule the held requests whose grammar is compiled; fail those whose compile raised."""
        if not len(self.grammars):
            return
        if not self.scheduler.has_unfinished():
            self.grammars.wait(GRAMMAR_WAIT_S)  # nothing else to run: wait for a compile, not spin
        ready, failed = self.grammars.ready()
        for request in ready:
            self.scheduler.add(request)
        if failed:
            raise StepFailed([r.req_id for r, _ in failed], failed[0][1])

    def step(self) -> list[EngineCoreOutput]:
        self._admit_compiled()
        out = self.scheduler.schedule()
        # Before the forward, even of a step that runs nothing, and outside the step's failure: a
        # swapped-out request's KV is in its host blocks whatever the forward does.
        self.runner.copy_blocks(out)
        if out.is_empty:
            return []
        shape = StepShape.of((s.request.num_computed_tokens, s.num_scheduled_tokens) for s in out.scheduled)
        started, started_cpu = time.perf_counter(), time.thread_time()
        try:
            result = self.runner.execute(out)
        except Exception as exc:
            if self.runner.fanout is not None:
                raise
            req_ids = [s.request.req_id for s in out.scheduled]
            self.num_failed_requests += len(req_ids)
            raise StepFailed(req_ids, exc) from exc
        self.step_totals.add(shape, time.perf_counter() - started, time.thread_time() - started_cpu)
        self.scheduler.update_after_step(out)
        for scores in result.prompt_scores:
            _record_prompt_scores(scores)
        return [out for s in result.sampled for out in self._process(s)]

    def _process(self, sampled: SampledToken) -> list[EngineCoreOutput]:
        request = sampled.scheduled.request
        if not sampled.forks and not request.pending_forks:  # the common case: no siblings
            return [self._accept_token(request, sampled.token_id, sampled.logprobs)]
        # Forks first: the parent's own token may finish it, and free the blocks they share.
        for f in request.pending_forks:
            del self._fork_parents[f.req_id]
        request.pending_forks = []
        forked = [self.fork(request.req_id, f.req_id, f.token_id, f.logprobs, f.sample_index) for f in sampled.forks]
        self.num_forked_samples += len(forked)
        return [self._accept_token(request, sampled.token_id, sampled.logprobs), *forked]

    def _accept_token(self, request: Request, token_id: int, logprobs: TokenLogprobs | None) -> EngineCoreOutput:
        request.append_output_token(token_id)
        if request.grammar is not None:
            request.grammar.accept(token_id)
        out = EngineCoreOutput(request.req_id, token_id, logprobs, None, request.num_prompt_tokens,
                               request.num_cached_tokens, prompt_logprobs=request.prompt_logprobs)
        # Handed out once, with the first token: a recompute after a preemption scores nothing again.
        request.prompt_logprobs = None
        if request.hands_off:
            # Whether this token stops the request is for the engine that continues it to say.
            request.hand_off()
            out.handoff_blocks = self._leave(request)
            return out
        out.finish_reason = token_finish_reason(
            token_id, request.num_output_tokens, request.num_tokens, request.params,
            self.loaded.eos_token_ids, self.max_model_len,
        )
        if out.finish_reason is None and request.grammar is not None and request.grammar.terminated:
            out.finish_reason = FinishReason.STOP  # the grammar is complete (its stop token, even under ignore_eos)
        if out.finish_reason is None:
            return out
        if out.finish_reason is FinishReason.STOP and token_id in request.params.stop_token_ids:
            out.stop_token_id = token_id
        request.finish(out.finish_reason)
        self.scheduler.finish(request)
        del self._requests[request.req_id]
        return out

    def _leave(self, request: Request) -> list[KVBlock]:
        """Take a request out of this engine; its blocks go to the caller, still held."""
        del self._requests[request.req_id]
        self.scheduler.remove(request)
        self.grammars.remove(request)
        return self.kv.take_blocks(request)

    def _validate(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  resumed_token_ids: Sequence[int]) -> None:
        if self._is_taken(req_id):
            raise RequestRejected(f"req_id {req_id!r} is already in use")
        if not prompt_token_ids:
            raise RequestRejected("prompt_token_ids must not be empty")
        vocab = self.loaded.vocab_size
        for name, ids in (("prompt_token_ids", prompt_token_ids), ("resumed_token_ids", resumed_token_ids)):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestRejected(f"{name} contains {bad}, outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestRejected(
                f"prompt_token_ids has {len(prompt_token_ids)} tokens; the model holds {self.max_model_len}"
            )
        # A resumed sample had not ended: it has room for at least one more token.
        if len(resumed_token_ids) >= params.max_tokens:
            raise RequestRejected(f"resumed_token_ids has {len(resumed_token_ids)} tokens; max_tokens is "
                                  f"{params.max_tokens}, so the sample has already ended")
        if len(prompt_token_ids) + len(resumed_token_ids) >= self.max_model_len:
            raise RequestRejected(f"prompt_token_ids + resumed_token_ids have "
                                  f"{len(prompt_token_ids) + len(resumed_token_ids)} tokens; the model holds "
                                  f"{self.max_model_len}")
        self._check_kv_fits(len(prompt_token_ids), params.max_tokens)

    def _check_kv_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """The one capacity rule: can this request's KV ever fit this engine's cache?"""
        blocks_needed = self.kv.blocks_needed(min(num_prompt_tokens + max_tokens, self.max_model_len))
        if blocks_needed > self.num_blocks:
            raise KVCapacityExceeded(blocks_needed, self.num_blocks)

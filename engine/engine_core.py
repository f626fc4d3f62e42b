"""The engine core: one step is schedule → run → update.

Owns the scheduler, the KV cache manager and the model runner of one node. Token-level
stopping (eos, stop token ids, max_tokens, the model's length) happens here; text-level
stopping (stop strings) belongs to whoever detokenizes, which then calls `abort`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.block_pool import KVBlock
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.model_loader import LoadedModel, load_model
from pdserve.engine.model_runner import ModelRunner, SampledToken, kv_block_bytes
from pdserve.engine.policy import SchedulingPolicy
from pdserve.engine.request import FinishReason, Request
from pdserve.engine.sampler import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.stop_rules import token_finish_reason


@dataclass(slots=True)
class EngineCoreOutput:
    req_id: str
    new_token_id: int
    logprobs: TokenLogprobs | None
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int


class RequestRejected(ValueError):
    """A request this engine can never serve; the message names the field at fault."""


class EngineCore:
    def __init__(self, config: EngineConfig, policy: SchedulingPolicy | None = None, loaded: LoadedModel | None = None):
        # Resolved once, here, so every reader (KV cache, fingerprint, logs) sees the same dtype.
        config = config.resolved()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.loaded = loaded or load_model(config.model, config.torch_dtype, config.model_impl)
        self.max_model_len = min(config.max_model_len or self.loaded.max_model_len, self.loaded.max_model_len)
        num_blocks = config.num_blocks or max(
            1, config.kv_cache_bytes // kv_block_bytes(self.loaded, config.block_size, config.torch_dtype)
        )
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, policy or SchedulingPolicy(), config.max_num_batched_tokens, config.max_num_seqs)
        self.runner = ModelRunner(self.loaded, self.kv, num_blocks, config.torch_dtype, config.attention_backend)
        self._requests: dict[str, Request] = {}
        self._seeds = random.Random(config.seed)
        self._arrivals = 0

    @property
    def num_blocks(self) -> int:
        return self.kv.pool.num_blocks

    def add_request(
        self, req_id: str, prompt_token_ids: list[int], params: SamplingParams, sample_index: int = 0,
        resumed_token_ids: Sequence[int] = (),
    ) -> Request:
        request = self.new_request(req_id, prompt_token_ids, params, sample_index, resumed_token_ids)
        self.scheduler.add(request)
        return request

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
                          output_token_ids=list(resumed_token_ids))
        self._arrivals += 1
        self._requests[req_id] = request
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
        out = self._accept_token(request, first_token_id, None)
        if out.finish_reason is None:
            self.scheduler.add(request)
        return out

    def detach(self, req_id: str) -> list[KVBlock]:
        """Forget a never-scheduled request; its blocks go to the caller, still held.

        The caller frees them with `kv.pool.free` once nothing can write into them any
        more (a decode node's reserved blocks may still be receiving a prefill's KV).
        """
        request = self._check_unscheduled(req_id)
        del self._requests[req_id]
        request.finish(FinishReason.ABORT)
        return self.kv.take_blocks(request)

    def _check_unscheduled(self, req_id: str) -> Request:
        request = self._requests.get(req_id)
        if request is None:
            raise KeyError(f"unknown request {req_id!r}")
        if request in self.scheduler.running or request in self.scheduler.waiting:
            raise ValueError(f"request {req_id!r} is already scheduled")
        return request

    def abort(self, req_id: str) -> bool:
        request = self._requests.pop(req_id, None)
        if request is None:
            return False
        request.finish(FinishReason.ABORT)
        self.scheduler.finish(request)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        sampled = self.runner.execute(out)
        self.scheduler.update_after_step(out)
        return [self._process(s) for s in sampled]

    def _process(self, sampled: SampledToken) -> EngineCoreOutput:
        return self._accept_token(sampled.scheduled.request, sampled.token_id, sampled.logprobs)

    def _accept_token(self, request: Request, token_id: int, logprobs: TokenLogprobs | None) -> EngineCoreOutput:
        request.append_output_token(token_id)
        reason = self._finish_reason(request, token_id)
        if reason is not None:
            request.finish(reason)
            self.scheduler.finish(request)
            del self._requests[request.req_id]
        return EngineCoreOutput(
            request.req_id,
            token_id,
            logprobs,
            reason,
            request.num_prompt_tokens,
            request.num_cached_tokens,
        )

    def _finish_reason(self, request: Request, token_id: int) -> FinishReason | None:
        reason = token_finish_reason(
            token_id, request.num_output_tokens, request.num_tokens, request.params,
            self.loaded.eos_token_ids, self.max_model_len,
        )
        if reason is FinishReason.STOP and token_id in request.params.stop_token_ids:
            request.stop_token_id = token_id
        if reason is None and self.scheduler.policy.finishes_after_first_token():
            return FinishReason.LENGTH
        return reason

    def _validate(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  resumed_token_ids: Sequence[int]) -> None:
        if req_id in self._requests:
            raise RequestRejected(f"req_id {req_id!r} is already in use")
        if not prompt_token_ids:
            raise RequestRejected("prompt_token_ids must not be empty")
        vocab = self.loaded.vocab_size
        for name, ids in (("prompt_token_ids", prompt_token_ids), ("resumed_token_ids", resumed_token_ids)):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestRejected(f"{name} contains {bad}, outside the vocabulary [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
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
        max_tokens = min(total, self.max_model_len)
        if self.kv.blocks_needed(max_tokens) > self.num_blocks:
            raise RequestRejected(
                f"prompt_token_ids + max_tokens need {self.kv.blocks_needed(max_tokens)} KV blocks; "
                f"this engine has {self.num_blocks}"
            )

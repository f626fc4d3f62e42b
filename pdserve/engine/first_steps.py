"""The first steps an engine runs, before it serves: a model that cannot run is refused at start.

`check_first_steps` runs one packed prefill of two prompts and one decode step of both through
the real runner (every tensor-parallel rank, the real attention backend, the real sampler) on
dummy requests in blocks of a scratch block manager: the engine's own block pool, its free
order and its prefix cache are untouched. It refuses the model (`ModelRefused`, one line naming
the folder) when
- a step raises: the model would fail its first request instead, and every one after;
- on the transformers path, the engine's paged attention was not called once per layer, or a
  layer asked it for something the paged kernels do not do (its own mask or bias, a sliding
  window, soft-capping, sinks): the model's own attention computed the step (a class that
  ignores `AttentionInterface`, such as Falcon's) or would be computed wrongly;
- on the transformers path with one rank, the step's logits differ from the model's own
  computation of each sequence alone (transformers' eager attention, no packing, no cache):
  whatever else a model does across the packed batch (positions of its own, recurrent state),
  it must give the same next-token distribution. Tensor-parallel ranks skip this comparison
  (its forward would need every rank); the same class is checked on one rank.

Must never: run while requests are scheduled (it borrows the cache's memory), or serve a
model it refused.
"""

from __future__ import annotations

import logging

import torch

from pdserve.engine.attention import AttentionProbe
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.model_folder import ModelRefused, one_line
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.models.hf import TransformersCausalLM
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

FIRST_STEP_PROMPT_LENS = (3, 19)  # two prompts in one packed step, one of them past a block boundary
# Cosine similarity of the engine's next-token logits and the model's own, at least: float32
# rounding keeps it above 0.999999 and bfloat16's above 0.9999 in the model sweep's 2-layer
# models. Attention over the wrong tokens or positions, or a layer that ignores the cache,
# falls far below (0.2 to 0.6); a subtler error, such as recurrent state carried across the
# packed batch, to about 0.9999, which float32 still catches.
MIN_LOGITS_SIMILARITY_FP32 = 0.99999
MIN_LOGITS_SIMILARITY = 0.999  # bfloat16 and float16


def check_first_steps(runner: ModelRunner, model_dir: str) -> None:
    """Run a packed prefill and a decode step; raise `ModelRefused` if the model cannot serve."""
    loaded, kv = runner.loaded, runner.kv
    requests = [Request(f"first-step-{n}", [(7 * i + 1) % loaded.vocab_size for i in range(n)],
                        SamplingParams(max_tokens=2), -1, seed=0) for n in FIRST_STEP_PROMPT_LENS]
    # Only the blocks these steps use: their ids exist in the cache, and a pool this small starts at once.
    needed = sum(-(-(n + 1) // kv.block_size) for n in FIRST_STEP_PROMPT_LENS)
    scratch = KVCacheManager(min(needed, kv.pool.num_blocks), kv.block_size, enable_caching=False)
    if not all(scratch.allocate_slots(r, r.num_prompt_tokens + 1) is not None for r in requests):
        logger.warning("first steps skipped: %d KV blocks hold no two short prompts", kv.pool.num_blocks)
        return
    model = loaded.model if isinstance(loaded.model, TransformersCausalLM) else None
    probe = AttentionProbe()
    runner.kv = scratch
    if model is not None:
        model.step_slot.probe = probe
    try:
        prefill = _run(runner, requests, model_dir)  # every prompt token
        _check_attention_calls(probe, loaded.num_layers, loaded.config, model is not None, model_dir)
        decode = _run(runner, requests, model_dir)  # the token each prompt just sampled
    finally:
        runner.kv = kv
        if model is not None:
            model.step_slot.probe = None
    agreement = ""
    if model is not None and loaded.shard.is_single:
        similarity = min(_check_logits(model, step, model_dir) for step in (prefill, decode))
        agreement = f"; logits agree with the model's own attention (cosine similarity >= {similarity:.6f})"
    logger.info("first steps ran: a packed prefill of %s tokens and a decode step%s",
                list(FIRST_STEP_PROMPT_LENS), agreement)


def _run(runner: ModelRunner, requests: list[Request], model_dir: str) -> list[tuple[list[int], torch.Tensor]]:
    """One step of every request's uncomputed tokens; each appends the token it sampled. Returns
    each sampled row's context (the tokens its logits follow) and logits."""
    out = SchedulerOutput([ScheduledRequest(r, r.num_tokens - r.num_computed_tokens) for r in requests])
    try:
        result = runner.execute(out)
    except Exception as exc:  # noqa: BLE001 - whatever the model raises, it would raise on every request
        raise ModelRefused("model", model_dir, f"the model fails its first step on this engine: "
                                               f"{type(exc).__name__}: {one_line(exc)}") from exc
    rows = []
    for sampled, logits in zip(result.sampled, result.logits):
        request = sampled.scheduled.request
        rows.append((list(request.token_ids), logits))
        request.num_computed_tokens = request.num_tokens
        request.append_output_token(sampled.token_id)
    return rows


def _check_attention_calls(probe: AttentionProbe, num_layers: int, config, probed: bool, model_dir: str) -> None:
    # The native model runs its own attention (C++, no AttentionInterface): nothing to probe.
    if not probed:
        return
    name = ", ".join(config.architectures or [config.model_type])
    if sorted(probe.layer_calls) != list(range(num_layers)):
        raise ModelRefused("model", model_dir, f"{name}: the engine's paged attention ran for layers "
                                               f"{_layer_list(probe.layer_calls)} of {num_layers} in one step; "
                                               "this model class computes attention its own way")
    if probe.unsupported:
        raise ModelRefused("model", model_dir, f"{name}: its attention asks for {', '.join(sorted(probe.unsupported))}, "
                                               "which the engine's paged attention does not do")


def _check_logits(model: TransformersCausalLM, rows: list[tuple[list[int], torch.Tensor]], model_dir: str) -> float:
    """The least cosine similarity of the step's logits and the model's own; refused below the bar."""
    least = 1.0
    for context, logits in rows:
        own = model.own_logits(context)
        similarity = float(torch.nn.functional.cosine_similarity(logits.float(), own.float(), dim=0))
        if similarity < (MIN_LOGITS_SIMILARITY_FP32 if logits.dtype == torch.float32 else MIN_LOGITS_SIMILARITY):
            name = ", ".join(model.model.config.architectures or [model.model.config.model_type])
            raise ModelRefused("model", model_dir, f"{name}: on this engine its next-token logits after "
                                                   f"{len(context)} tokens differ from its own computation "
                                                   f"(cosine similarity {similarity:.6f}); it would answer wrong tokens")
        least = min(least, similarity)
    return least


def _layer_list(calls: list[int]) -> str:
    return str(sorted(calls)) if calls else "none"

"""A node's samples of one prompt share its blocks: each sample joins as a fork of a sibling when it can.

The router sends the n samples of a request separately (each its own req_id and sample_index,
nearly at once, each maybe to another node). When a sample reaches a node whose engine holds an
unsampled request with the same prompt and the same sampling params (seed included; prompt
logprobs aside, which only sample 0 asks for), it is attached to that request as a pending fork
(`EngineCore.add_fork`): its first token is drawn from the sibling's first logits with its own
sample_index — the draw a request of its own would make from the same logits — and it then
shares every prompt block, the partial last one included, copy-on-write. Otherwise, or when the
sibling has sampled meanwhile, it joins as a request of its own, as before. The colocated and
the prefill node both admit samples through `add_sample`.

Matching needs no request id: two requests with the same prompt, params and seed draw the same
tokens whether forked or not. Unseeded params never match, nor do resumed samples (their
outputs differ from the start).

Must never: fork a sample whose tokens would differ from its independent run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pdserve.engine.engine_core import EngineCore
from pdserve.engine.request import PendingFork, Request
from pdserve.engine.sampling_params import SamplingParams


def add_sample(engine: EngineCore, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
               sample_index: int, resumed_token_ids: Sequence[int] = (), hands_off: bool | None = None) -> bool:
    """Add one sample to the engine; True when it was attached as a fork of a sibling.
    `hands_off`: `EngineCore.add_request`'s; a sibling matches only if it leaves the same way.

    Raises what `EngineCore.add_request` raises (`RequestRejected`, `KVCapacityExceeded`).
    """
    if not resumed_token_ids:
        leaves = engine.policy.hands_off_after_first_token() if hands_off is None else hands_off
        sibling = find_sibling(engine, prompt_token_ids, params, leaves)
        if sibling is not None and engine.add_fork(sibling.req_id, PendingFork(req_id, sample_index)):
            return True
    engine.add_request(req_id, prompt_token_ids, params, sample_index, resumed_token_ids, hands_off=hands_off)
    return False


def find_sibling(engine: EngineCore, prompt_token_ids: list[int], params: SamplingParams,
                 hands_off: bool = False) -> Request | None:
    """A scheduled request that has not sampled yet, of the same prompt and params, that leaves
    this engine the same way (a fork inherits its parent's hand-off)."""
    if params.seed is None or params.prompt_logprobs is not None:
        return None
    scheduler = engine.scheduler
    for request in (*scheduler.waiting, *scheduler.running, *scheduler.swapped):
        if (not request.num_output_tokens and request.hands_off == hands_off
                and request.prompt_token_ids == prompt_token_ids and same_draws(request.params, params)):
            return request
    return None


def same_draws(parent: SamplingParams, child: SamplingParams) -> bool:
    """Do the two params draw the same tokens from the same logits? (Prompt logprobs are the
    parent's to report; a forked child reports none, as a child sample asks for none.)"""
    if child.prompt_logprobs is not None:
        return False
    return all(getattr(parent, name) == getattr(child, name) for name in _DRAW_FIELDS)


# Every field but prompt_logprobs: compared one by one, so matching builds no params.
_DRAW_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "prompt_logprobs")

"""Sibling samples that reach one node share their prompt's blocks: `EngineCore.add_fork` and
pdserve/node/core/sibling_forks.py, on a real tiny engine (blocks of 4 tokens) and on a prefill + decode pair.

Exact blocks and reference counts while the samples share the prompt; exactly the tokens the
same samples draw as requests of their own; zero blocks after.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine.admission import RequestRejected
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.model_loader import load_model
from pdserve.engine.policy import ColocatedPolicy
from pdserve.engine.request import PendingFork
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.messages import Abort, FirstToken, PrefillSubmit, Ready, StreamSubmit
from pdserve.node.core.sibling_forks import add_sample
from pdserve.prefill_node.kv_export import prefill_params

from .node_pair import Pair, engine_config

PROMPT = [(7 * i + 3) % 900 + 5 for i in range(10)]  # 10 tokens: blocks 0, 1 full, block 2 partial
SEEDED = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=11)


@pytest.fixture(scope="module")
def model(tiny_llama):
    model_dir = tiny_llama
    return str(model_dir), load_model(model_dir, torch.float32)


def engine(model, num_blocks: int = 16) -> EngineCore:
    model_dir, loaded = model
    return EngineCore(engine_config(model_dir, num_blocks, budget=16), ColocatedPolicy(), loaded)


def run(core: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished():
        for out in core.step():
            tokens.setdefault(out.req_id, []).append(out.new_token_id)
    return tokens


def independent(model, n: int, params: SamplingParams = SEEDED) -> dict[str, list[int]]:
    """The n samples as requests of their own: what a node did before forking."""
    core = engine(model, num_blocks=64)
    for i in range(n):
        core.add_request(f"s{i}", PROMPT, params, i)
    return run(core)


def test_add_fork_shares_the_prompt_blocks_partial_one_included_and_copies_on_write(model):
    core = engine(model)
    refs = core.kv.pool.blocks
    core.add_request("s0", PROMPT, SEEDED, 0)
    assert core.add_fork("s0", PendingFork("s1", 1)) and core.add_fork("s0", PendingFork("s2", 2))
    first = core.step()  # the whole prompt, once; three tokens from its logits
    assert [out.req_id for out in first] == ["s0", "s1", "s2"]
    assert core.kv.block_ids("s0") == core.kv.block_ids("s1") == core.kv.block_ids("s2") == [0, 1, 2]
    assert [refs[b].ref_count for b in (0, 1, 2)] == [3, 3, 3] and core.kv.num_used_blocks == 3
    core.step()  # each writes its first token into the shared partial block: all but the last copy it
    assert core.kv.num_cow_copies == 2 and core.kv.num_used_blocks == 5
    assert [refs[b].ref_count for b in (0, 1)] == [3, 3]
    core.step()  # token 11 still fits in each sample's own copy: nothing new
    assert core.kv.num_used_blocks == 5
    run(core)
    assert core.num_forked_samples == 2
    assert core.kv.num_used_blocks == 0 and not core.has_unfinished()


def test_forked_samples_draw_exactly_the_independent_samples_tokens(model):
    core = engine(model)
    for i in range(3):
        assert add_sample(core, f"s{i}", PROMPT, SEEDED, i) is (i > 0)
    assert run(core) == independent(model, 3)
    assert core.num_forked_samples == 2 and core.kv.num_used_blocks == 0


def test_a_sample_forks_only_off_a_sibling_that_leaves_the_engine_the_same_way(model):
    """A decode node with --serve-prefill holds prompts it decodes and prompts it exports at token 1:
    a sample of one is never forked off the other (a fork leaves as its parent does)."""
    core = engine(model)
    assert add_sample(core, "own", PROMPT, SEEDED, 0) is False
    assert add_sample(core, "exported", PROMPT, SEEDED, 1, hands_off=True) is False  # not off "own"
    assert add_sample(core, "exported-2", PROMPT, SEEDED, 2, hands_off=True) is True  # off "exported"
    assert add_sample(core, "own-2", PROMPT, SEEDED, 3) is True  # off "own"
    outputs = []
    while core.has_unfinished():
        outputs.extend(core.step())
    handed_off = sorted(out.req_id for out in outputs if out.handoff_blocks is not None)
    assert handed_off == ["exported", "exported-2"]
    for out in outputs:
        if out.handoff_blocks is not None:
            core.kv.pool.free(reversed(out.handoff_blocks))
    assert core.kv.num_used_blocks == 0


def test_add_fork_is_too_late_once_the_parent_has_sampled(model):
    core = engine(model)
    core.add_request("s0", PROMPT, SEEDED, 0)
    core.step()
    assert not core.add_fork("s0", PendingFork("s1", 1))
    assert not core.add_fork("gone", PendingFork("s1", 1))
    assert add_sample(core, "s1", PROMPT, SEEDED, 1) is False  # joins as its own request
    assert run(core).keys() == {"s0", "s1"} and core.num_forked_samples == 0
    assert core.kv.num_used_blocks == 0


def test_a_taken_req_id_is_refused(model):
    core = engine(model)
    core.add_request("s0", PROMPT, SEEDED, 0)
    assert core.add_fork("s0", PendingFork("s1", 1))
    for fork in (PendingFork("s0", 1), PendingFork("s1", 2)):
        with pytest.raises(RequestRejected, match="already in use"):
            core.add_fork("s0", fork)
    with pytest.raises(RequestRejected, match="already in use"):
        core.add_request("s1", PROMPT, SEEDED, 1)
    run(core)
    assert core.kv.num_used_blocks == 0


@pytest.mark.parametrize("leave", ["abort", "detach"])
def test_a_parent_leaving_before_its_first_token_promotes_its_pending_samples(model, leave):
    core = engine(model)
    for i in range(3):
        add_sample(core, f"s{i}", PROMPT, SEEDED, i)
    if leave == "abort":
        assert core.abort("s0")
    else:
        core.kv.pool.free(reversed(core.detach("s0")))
    got = run(core)
    expected = independent(model, 3)
    assert got == {"s1": expected["s1"], "s2": expected["s2"]}
    assert core.num_forked_samples == 0 and core.kv.num_used_blocks == 0


def test_a_pending_sample_aborted_is_dropped_from_its_parents_forks(model):
    core = engine(model)
    for i in range(3):
        add_sample(core, f"s{i}", PROMPT, SEEDED, i)
    assert core.abort("s1") and not core.abort("s1")
    assert core.detach("s2") == []
    expected = independent(model, 1)
    assert run(core) == {"s0": expected["s0"]}
    assert core.num_forked_samples == 0 and core.kv.num_used_blocks == 0


@pytest.mark.parametrize("other", [
    dict(seed=12), dict(seed=None), dict(temperature=0.5), dict(prompt_logprobs=2), dict(max_tokens=4)],
    ids=["seed", "unseeded", "temperature", "prompt-logprobs", "max-tokens"])
def test_only_the_same_prompt_and_draws_fork(model, other):
    core = engine(model, num_blocks=32)
    parent_params = SEEDED if other.get("seed", 0) is not None else dataclasses.replace(SEEDED, seed=None)
    add_sample(core, "s0", PROMPT, parent_params, 0)
    assert add_sample(core, "s1", PROMPT, dataclasses.replace(SEEDED, **other), 1) is False
    assert add_sample(core, "s2", PROMPT[:-1], SEEDED, 2) is False
    assert add_sample(core, "s3", PROMPT, SEEDED, 3, resumed_token_ids=[5]) is False
    run(core)
    assert core.num_forked_samples == 0 and core.kv.num_used_blocks == 0


def test_sample_zero_keeps_its_prompt_logprobs_and_the_fork_reports_none(model):
    core = engine(model)
    scored = dataclasses.replace(SEEDED, prompt_logprobs=1)
    core.add_request("s0", PROMPT, scored, 0)
    assert add_sample(core, "s1", PROMPT, SEEDED, 1)
    first = {out.req_id: out for out in core.step()}
    assert len(first["s0"].prompt_logprobs) == len(PROMPT) - 1 and first["s1"].prompt_logprobs is None
    run(core)
    assert core.kv.num_used_blocks == 0


# -- a prefill node: each sample's KV goes to its own decode reservation ----------------------
def test_prefill_node_forks_samples_and_exports_each_to_its_own_reservation(model):
    pair = Pair(*model)
    readies: dict[str, Ready] = {}
    for i in range(3):  # the router reserves on the decode node first, then asks the prefill node
        pair.decode.handle(StreamSubmit(f"s{i}", PROMPT, SEEDED, i, imports_kv=True))
        readies[f"s{i}"] = pair.d_out.pop()
    for i, (req_id, ready) in enumerate(readies.items()):
        pair.prefill.handle(PrefillSubmit(req_id, PROMPT, prefill_params(SEEDED), i, ready.kv_layout_id,
                                          ready.block_ids, kv_layout=pair.d_layout))
    assert pair.p_engine.num_forked_samples == 0  # counted when forked, at the first token
    pair.tick()
    pair.tick()  # two chunks of 8: the prompt once, three first tokens; the forks leave sharing its blocks
    assert pair.p_engine.num_forked_samples == 2
    held = pair.exporter.num_held_blocks()
    assert held == 9 and pair.p_engine.kv.num_used_blocks == 3  # three hand-offs of the same 3 blocks
    pair.run()
    firsts = {m.req_id: m for m in pair.p_out if isinstance(m, FirstToken)}
    got = {r: [firsts[r].token_id] + [t for e in pair.decoded(r) for t in e.token_ids] for r in readies}
    assert got == independent(model, 3)
    assert all(firsts[r].kv_transfer_bytes == firsts["s0"].kv_transfer_bytes > 0 for r in readies)
    assert pair.all_blocks_returned()


def test_prefill_node_abort_of_the_parent_lets_its_pending_samples_go_on(model):
    pair = Pair(*model)
    readies = {}
    for i in range(2):
        pair.decode.handle(StreamSubmit(f"s{i}", PROMPT, SEEDED, i, imports_kv=True))
        readies[f"s{i}"] = pair.d_out.pop()
        pair.prefill.handle(PrefillSubmit(f"s{i}", PROMPT, prefill_params(SEEDED), i, readies[f"s{i}"].kv_layout_id,
                                          readies[f"s{i}"].block_ids, kv_layout=pair.d_layout))
    pair.prefill.handle(Abort("s0"))
    pair.decode.handle(Abort("s0"))
    pair.run()
    firsts = {m.req_id: m for m in pair.p_out if isinstance(m, FirstToken)}
    assert set(firsts) == {"s1"} and pair.p_engine.num_forked_samples == 0
    got = [firsts["s1"].token_id] + [t for e in pair.decoded("s1") for t in e.token_ids]
    assert got == independent(model, 2)["s1"]
    assert pair.all_blocks_returned()

"""Random add / step / abort / export-done sequences on tiny pools, under both policies.

After every operation SchedLoop checks: blocks are conserved (each block's ref count is
its number of holders, the free queue holds exactly the unreferenced ones), every
request's blocks hold its own KV for each computed token and cover no more, cached blocks
hold the prefix their hash names, and the queues agree with the request states. After each
step, also: running requests all arrived before every waiting one (first come, first
served), and a step that preempted admitted nobody. Then the sequence is run to the end:
every request finishes with its full output and the pool is empty again.

Prompts share a 16-token base and sampled tokens come from a tiny alphabet, so prefix
hits, shared blocks and cached blocks whose content recurs are common.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_scheduler_harness import PolicySetup, SchedLoop, always, colocated, prefill

BASE = list(range(1, 17))
POLICIES = {"colocated": colocated, "prefill": prefill}


@dataclass(frozen=True)
class Add:
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Step:
    token_id: int


@dataclass(frozen=True)
class Abort:
    pick: int  # which live request, modulo their number


@dataclass(frozen=True)
class ExportDone:
    pick: int  # which handed-over request the exporter is done with


pools = st.fixed_dictionaries({
    "num_blocks": st.integers(3, 10),
    "block_size": st.sampled_from([1, 2, 4]),
    "budget": st.integers(1, 12),
    "max_seqs": st.integers(1, 4),
    "caching": st.booleans(),
})


@st.composite
def operations(draw, capacity: int) -> list[object]:
    """Up to 60 operations whose requests (prompt + output) fit `capacity` tokens."""
    def add(prompt_len: int, max_tokens: int, tail: list[int]) -> Add:
        base = BASE[: max(prompt_len - len(tail), 0)]
        return Add(tuple(base + tail)[:prompt_len], max_tokens)

    adds = st.integers(1, capacity - 1).flatmap(lambda n: st.builds(
        add, st.just(n), st.integers(1, capacity - n), st.lists(st.integers(0, 2), max_size=3)))
    steps = st.builds(Step, st.integers(0, 2))
    return draw(st.lists(st.one_of(
        adds, adds, adds, steps, steps, steps,  # three times as often as the rest: queues fill up
        st.builds(Abort, st.integers(0, 99)),
        st.builds(ExportDone, st.integers(0, 99)),
    ), min_size=10, max_size=60))


def apply(loop: SchedLoop, setup: PolicySetup, op: object, num_added: int) -> int:
    """One operation; returns how many requests have been added so far."""
    if isinstance(op, Add):
        # A prefill node samples one token, whatever max_tokens says.
        max_tokens = 1 if setup.policy.hands_off_after_first_token() else op.max_tokens
        loop.add(f"r{num_added}", list(op.prompt), max_tokens)
        return num_added + 1
    elif isinstance(op, Step):
        loop.step(always(op.token_id))
    elif isinstance(op, Abort) and loop.live:
        loop.abort(sorted(loop.live)[op.pick % len(loop.live)])
    elif isinstance(op, ExportDone) and loop.exports:
        loop.free_exports([list(loop.exports)[op.pick % len(loop.exports)]])
    return num_added


@st.composite
def scenarios(draw) -> tuple[str, dict, list[object]]:
    pool = draw(pools)
    return draw(st.sampled_from(sorted(POLICIES))), pool, draw(operations(pool["num_blocks"] * pool["block_size"]))


@settings(max_examples=300, deadline=None)
@given(scenario=scenarios())
def test_random_sequences_keep_every_invariant_and_drain_to_an_empty_pool(scenario):
    policy, pool, ops = scenario
    setup = POLICIES[policy]()
    loop = SchedLoop(setup, **pool)
    num_added = 0
    for op in ops:
        num_added = apply(loop, setup, op, num_added)
    loop.run_to_completion()
    assert not loop.live and not loop.exports
    assert loop.kv.num_used_blocks == 0 and loop.kv.num_free_blocks == pool["num_blocks"]
    for request in loop.finished:
        assert request.num_output_tokens == request.params.max_tokens
    assert len(loop.finished) + len(loop.aborted) == num_added

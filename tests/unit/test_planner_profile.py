"""The step-time model's fit and the profile cache: nothing measured, numbers set by hand."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.engine.step_shape import StepShape
from pdserve.planner.measure import step_shapes
from pdserve.planner.profile import NodeSetup, ProfileCache, machine_facts, model_hash, profile_key
from pdserve.planner.profile_cli import tp_setups
from pdserve.planner.step_cost import StepCost
from tests.unit.planner_profiles import synthetic_profile


def test_a_step_shape_counts_tokens_requests_and_both_kinds_of_attention():
    shape = StepShape.of([(10, 1), (20, 1), (0, 8), (16, 4)])
    assert shape == StepShape(tokens=14, requests=4, attended=8 * 9 // 2 + 4 * 16 + 4 * 5 // 2,
                              decode_context=11 + 21)


def test_the_fit_recovers_the_coefficients_that_made_the_samples():
    truth = StepCost(0.002, 1e-4, 5e-5, 2e-8, 3e-7)
    shapes = [StepShape.of(c) for c in ([(0, 16)], [(0, 256)], [(512, 256)], [(128, 1)] * 4, [(1024, 1)] * 32,
                                         [(256, 1)] * 8 + [(0, 128)], [(0, 1024)])]
    fitted = StepCost.fit([(s, truth.time(s)) for s in shapes])
    for name in ("base_s", "per_token_s", "per_seq_s", "per_attended_s", "per_decode_context_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    assert fitted.relative_error([(s, truth.time(s)) for s in shapes]) == pytest.approx(0.0, abs=1e-9)


def test_no_coefficient_of_the_fit_is_negative():
    # Time falls with the batch here (noise): a negative per-token cost would price big steps below zero.
    samples = [(StepShape.of([(100, 1)] * b), 0.01 - 0.0001 * b) for b in (1, 2, 4, 8)]
    fitted = StepCost.fit(samples)
    assert min(dataclasses.astuple(fitted)) >= 0


def test_a_profile_round_trips_through_the_cache(tmp_path):
    cache = ProfileCache(tmp_path)
    profile = synthetic_profile(base_s=0.01, per_token_s=0.001)
    cache.store("k", profile)
    assert cache.load("k") == profile
    assert cache.load("other") is None
    (tmp_path / "bad.json").write_text("{")
    assert cache.load("bad") is None  # unreadable: measured again


def test_the_cache_key_changes_with_the_model_the_machine_and_the_setup(tmp_path):
    (tmp_path / "config.json").write_text('{"a": 1}')
    digest = model_hash(tmp_path)
    machine = machine_facts("model name : X\nflags : avx2 fma sse\n", cores=2)
    assert machine == {"cpu": "X", "flags": ["avx2", "fma"], "cores": 2}
    setup = NodeSetup(1, "bfloat16", 16)
    key = profile_key(digest, machine, setup)
    assert key == profile_key(digest, dict(machine), NodeSetup(1, "bfloat16", 16))
    assert key != profile_key(digest, {**machine, "cores": 4}, setup)
    assert key != profile_key(digest, machine, NodeSetup(2, "bfloat16", 16))
    assert profile_key(digest, machine, NodeSetup(2, "bfloat16", 16, 2)) != profile_key(digest, machine,
                                                                                    NodeSetup(2, "bfloat16", 16))
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert model_hash(tmp_path) != digest


def test_the_measured_steps_stay_within_the_models_length():
    shapes = list(step_shapes(600))
    assert {kind for kind, _ in shapes} == {"prefill", "decode", "mixed"}
    assert all(computed + scheduled <= 599 for _, chunks in shapes for computed, scheduled in chunks)


def test_the_serving_stacks_costs_are_cached_beside_the_profiles(tmp_path):
    from pdserve.planner.profile import ClientCost, FrontCost, RouterCost, stack_keys

    cache = ProfileCache(tmp_path)
    machine = {"cpu": "X", "flags": [], "cores": 2}
    keys = stack_keys("digest", machine)
    costs = (RouterCost(1e-4, 8e-5, "synthetic"), FrontCost(2e-4, 9e-5, "synthetic"), ClientCost(3e-4, 7e-5, "synthetic"))
    for key, cost in zip(keys, costs):
        cache.store(key, cost)
    assert [cache.load(key, type(cost)) for key, cost in zip(keys, costs)] == list(costs)
    assert len(set(keys)) == 3
    assert set(keys).isdisjoint(stack_keys("other", machine))
    assert stack_keys("digest", machine, stream_interval=1) == keys  # the default interval keeps its keys
    assert set(keys).isdisjoint(stack_keys("digest", machine, stream_interval=8))


def test_a_tp_size_is_profiled_for_every_threads_count_it_divides():
    assert tp_setups([1, 2, 4], [1, 2]) == [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)]
    assert tp_setups([1], [2]) == []

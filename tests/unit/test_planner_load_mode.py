"""The planner's load mode (pdserve/planner/load_mode.py): the window read back from two scrapes of the
router's own metrics, and the split it moves toward on synthetic profiles."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.bench.serve.metrics import Slo
from pdserve.engine.config import EngineConfig
from pdserve.planner.load_mode import Hold, LoadModeConfig, Rebalancer, Scrape, Split, Window
from pdserve.proto import pdserve_pb2
from pdserve.router.fronts.metrics import RouterMetrics
from tests.unit.planner_profiles import synthetic_profile

SLO = Slo(ttft_s=1.0, tpot_s=0.05)


def finish(metrics: RouterMetrics, prompt: int, output: int, ttft_s: float, tpot_s: float) -> None:
    """One request of one sample through the router's metrics, from arrival to its last response."""
    last = pdserve_pb2.GenerateResponse(usage=pdserve_pb2.Usage(prompt_tokens=prompt, completion_tokens=output),
                                        timings=pdserve_pb2.Timings(ttft_s=ttft_s, e2e_s=ttft_s + tpot_s * (output - 1)))
    asyncio.run(drain(metrics.observe(one(last), lambda completed, error: grpc.StatusCode.OK)))


async def one(response):
    yield response


async def drain(stream) -> None:
    async for _ in stream:
        pass


def test_the_window_reads_the_rate_the_mix_and_the_slo_shares_back_from_the_histograms():
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    finish(metrics, 100, 10, 0.2, 0.01)  # before the window: not counted
    before = Scrape.parse(generate_latest(registry).decode(), at_s=10.0)
    for _ in range(3):
        finish(metrics, 100, 10, 0.2, 0.01)  # within both SLOs
    finish(metrics, 1000, 300, 3.0, 0.2)  # misses both
    window = Window.between(before, Scrape.parse(generate_latest(registry).decode(), at_s=12.0), SLO)

    assert window.rate == 4 / 2.0  # arrived: ended, as none is in flight at either scrape
    # Each bucket's count spread evenly across it: three in (96, 128], one in (768, 1024] ...
    assert sorted(p for p, _ in window.mix) == [101, 112, 123, 896]
    assert sorted(o for _, o in window.mix) == [9, 12, 15, 320]  # ... three in (8, 16], one in (256, 384]
    assert window.ttft_share == window.tpot_share == 0.75
    assert not window.meets(0.9) and window.meets(0.75)


def test_a_router_that_restarted_between_scrapes_gives_an_empty_window():
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    for _ in range(2):
        finish(metrics, 10, 10, 0.1, 0.01)
    before = Scrape.parse(generate_latest(registry).decode(), at_s=0.0)
    after = Scrape.parse(generate_latest(RouterMetrics(CollectorRegistry()).registry).decode(), at_s=5.0)
    window = Window.between(before, after, SLO)
    assert window.mix == () and window.rate == 0.0 and window.meets(0.9)


def test_requests_still_in_flight_count_as_arrived():
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    before = Scrape.parse(generate_latest(registry).decode(), at_s=0.0)
    finish(metrics, 10, 10, 0.1, 0.01)
    for _ in range(3):
        metrics._in_flight.inc()  # arrived, no token yet (an overloaded prefill pool)
    window = Window.between(before, Scrape.parse(generate_latest(registry).decode(), at_s=2.0), SLO)
    assert window.rate == 4 / 2.0 and len(window.mix) == 1


# A node whose step costs 2 ms plus 0.2 ms per token and 1 ms per request in it.
PROFILE = synthetic_profile(base_s=0.002, per_token_s=0.0002, per_seq_s=0.001)
ENGINE = EngineConfig(model="synthetic", dtype="float32", block_size=16, max_num_batched_tokens=512,
                      max_num_seqs=64, num_blocks=100_000)


def rebalancer(slo: Slo, **kw) -> Rebalancer:
    return Rebalancer(LoadModeConfig(slo, **kw), ENGINE, ENGINE, PROFILE)


def window(rate: float, prompt: int, output: int, share: float = 0.5, count: int = 32) -> Window:
    return Window(rate, ((prompt, output),) * count, share, share)


def test_long_outputs_move_a_prefill_node_to_the_decode_pool():
    decide = rebalancer(Slo(ttft_s=2.0, tpot_s=0.03))
    move = decide.decide(window(rate=6.0, prompt=32, output=256), Split(2, 1))
    assert (move.source, move.target) == ("prefill", "decode")
    assert move.best.decode > 1 and move.predicted[move.best] >= move.predicted[Split(2, 1)] + 0.05


def test_long_prompts_move_a_decode_node_to_the_prefill_pool():
    decide = rebalancer(Slo(ttft_s=0.6, tpot_s=0.5))
    move = decide.decide(window(rate=8.0, prompt=1500, output=4), Split(1, 2))
    assert (move.source, move.target) == ("decode", "prefill")
    assert move.best.prefill > 1


def test_a_window_that_meets_the_slos_or_says_too_little_moves_nothing():
    decide = rebalancer(Slo(ttft_s=2.0, tpot_s=0.03))
    assert decide.decide(window(6.0, 32, 256, share=0.95), Split(2, 1)) is None  # meets the target
    assert decide.decide(window(6.0, 32, 256, count=4), Split(2, 1)) is None  # too few samples


def test_no_move_when_the_best_split_gains_less_than_the_margin_and_the_hold_names_every_prediction():
    decide = rebalancer(Slo(ttft_s=2.0, tpot_s=0.03), margin=1.0)  # no split can gain a whole 100%
    hold = decide.decide(window(6.0, 32, 256), Split(2, 1))
    assert isinstance(hold, Hold) and sorted(hold.predicted) == [Split(1, 2), Split(2, 1)]
    assert hold.predicted == {split: decide.attainment(split, window(6.0, 32, 256)) for split in hold.predicted}
    figures = ", ".join(f"{s.describe()} {hold.predicted[s]:.0%}" for s in (Split(1, 2), Split(2, 1)))
    assert hold.describe(Split(2, 1)) == ("no other split of 3 nodes is predicted to do better by the margin "
                                         f"(predicted attainment {figures})")


@pytest.mark.parametrize("nodes", [2, 3, 4])
def test_the_moves_describe_every_split_of_the_same_nodes(nodes):
    decide = rebalancer(Slo(ttft_s=2.0, tpot_s=0.03), margin=0.0)
    current = Split(nodes - 1, 1)
    move = decide.decide(window(6.0, 32, 256), current)
    if nodes == 2:
        assert isinstance(move, Hold) and list(move.predicted) == [current]  # 1P1D is the only split of two nodes
    else:
        assert sorted(move.predicted) == [Split(p, nodes - p) for p in range(1, nodes)]
        assert move.describe(current).startswith(f"a prefill node becomes a decode node ({nodes - 1}P1D toward ")


def _pool_argvs(model: str) -> list[tuple[str, ...]]:
    flags = ("--model", model, "--num-threads", "1", "--dtype", "float32", "--block-size", "8")
    return [("python", "-m", "pdserve", "prefill", *flags), ("python", "-m", "pdserve", "decode", *flags)]


def test_the_load_mode_charges_the_cached_router_and_fronts_never_the_client(tmp_path, tiny_llama):
    from pdserve.cluster_load_mode import LoadModeSettings, build_rebalancer
    from pdserve.planner.profile import (
        ClientCost, FrontCost, NodeSetup, ProfileCache, RouterCost, ServingCosts, machine_facts, model_hash,
        profile_key, stack_keys,
    )

    cache = ProfileCache(tmp_path)
    digest, machine = model_hash(tiny_llama), machine_facts()
    cache.store(profile_key(digest, machine, NodeSetup(1, "float32", 8)), synthetic_profile(base_s=0.001))
    settings = LoadModeSettings(ttft_slo=1.0, tpot_slo=0.1, profile_dir=str(tmp_path))
    said: list[str] = []
    assert build_rebalancer(settings, _pool_argvs(str(tiny_llama)), log=said.append).costs == ServingCosts()
    assert "the simulator charges none" in said[-1]

    router, front = RouterCost(1e-3, 1e-4, "synthetic"), FrontCost(2e-3, 2e-4, "synthetic")
    for key, cost in zip(stack_keys(digest, machine), (router, front, ClientCost(3e-3, 3e-4, "synthetic"))):
        cache.store(key, cost)
    assert build_rebalancer(settings, _pool_argvs(str(tiny_llama))).costs == ServingCosts(router, front)

    # A router holding 8 tokens per response: its costs at that interval once measured, the
    # one-token costs (an over-estimate, said) until then.
    router_argv = ("python", "-m", "pdserve", "router", "--port", "0", "--stream-interval", "8", "--decode", "h:1")
    said.clear()
    assert build_rebalancer(settings, _pool_argvs(str(tiny_llama)), router_argv, log=said.append).costs == \
        ServingCosts(router, front)
    assert said == ["load mode: the serving stack's CPU at --stream-interval 8 was never measured for this model "
                    "here (`pdserve plan --stream-intervals 8` measures it): the simulator charges its cost at "
                    "one token per response"]
    router_8, front_8 = RouterCost(1e-3, 1e-5, "synthetic"), FrontCost(2e-3, 2e-5, "synthetic")
    for key, cost in zip(stack_keys(digest, machine, 8), (router_8, front_8, ClientCost(3e-3, 3e-5, "synthetic"))):
        cache.store(key, cost)
    rebalancer = build_rebalancer(settings, _pool_argvs(str(tiny_llama)), router_argv)
    assert rebalancer.costs == ServingCosts(router_8, front_8)


def test_the_load_mode_simulates_the_machines_cores_unless_every_node_is_pinned(tmp_path, tiny_llama):
    from pdserve.cluster_load_mode import LoadModeSettings, build_rebalancer
    from pdserve.common.affinity import available_cpus
    from pdserve.planner.profile import NodeSetup, ProfileCache, machine_facts, model_hash, profile_key

    ProfileCache(tmp_path).store(profile_key(model_hash(tiny_llama), machine_facts(), NodeSetup(1, "float32", 8)),
                                 synthetic_profile(base_s=0.001))
    settings = LoadModeSettings(ttft_slo=1.0, tpot_slo=0.1, profile_dir=str(tmp_path))
    unpinned = _pool_argvs(str(tiny_llama))
    assert build_rebalancer(settings, unpinned).machine_cores == len(available_cpus())
    pinned = [(*argv, "--cpus", str(i)) for i, argv in enumerate(unpinned)]
    assert build_rebalancer(settings, pinned).machine_cores is None


def test_the_launchers_watcher_logs_a_hold_with_its_predictions_and_queues_a_move():
    from pdserve.cluster_load_mode import LoadModeSettings, LoadWatcher

    logged: list[str] = []
    seen = window(6.0, 32, 256)

    def watcher(margin: float) -> LoadWatcher:
        settings = LoadModeSettings(ttft_slo=2.0, tpot_slo=0.03, margin=margin)
        return LoadWatcher(Rebalancer(settings.load_mode(), ENGINE, ENGINE, PROFILE), settings, scrape=lambda: "",
                           split=lambda: Split(2, 1), busy=lambda: False, log=logged.append)

    holding = watcher(margin=1.0)
    holding._consider(seen)
    assert holding.moves.empty()
    [line] = logged
    assert line.startswith(f"load mode: {seen.describe()}; no other split of 3 nodes is predicted to do better by "
                           "the margin (predicted attainment 1P2D ")
    moving = watcher(margin=0.0)
    moving._consider(seen)
    move, split = moving.moves.get_nowait()
    assert (move.source, move.target, split) == ("prefill", "decode", Split(2, 1)) and len(logged) == 1

"""Conditional disaggregation at the router: where a request's prompt is computed when decode nodes
can also prefill (`--local-prefill`), per `--disaggregation` (pdserve/router/dispatch/hybrid.py).

The decision is pure, from token counts; the orchestrator's route follows it, takes only decode
nodes that registered with local_prefill for the local route, and refuses `never` without one.
"""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.router.config import RouterConfig
from pdserve.router.cluster.placement import DecodePlacement, PrefillPlacement
from pdserve.router.cluster.registry import NodeKind, NodeRegistry
from pdserve.router.dispatch.hybrid import Disaggregation, HybridRouting, Loads, PrefillChoice, PromptBudget
from pdserve.router.dispatch.orchestrator import Orchestrator
from pdserve.router.dispatch.routes import DisaggregatedRoute, Load, LocalPrefillRoute
from pdserve.router.dispatch.state import RouterState
from pdserve.router.errors import NoNodeAvailable
from pdserve.router.model import load_router_model
from pdserve.proto import node_pb2

AUTO = PrefillChoice(Disaggregation.AUTO, max_local_tokens=100)


@pytest.mark.parametrize("loads,local", [
    (Loads(60, prefill_queue=0, local_queue=40), True),  # 100 tokens on the decode node: within the bound
    (Loads(61, prefill_queue=0, local_queue=40), False),  # 101: the idle prefill pool takes it
    (Loads(500, prefill_queue=600, local_queue=0), True),  # the pool is further behind than the decode node
    (Loads(500, prefill_queue=500, local_queue=0), False),  # level: long prompts stay off the decode node
    (Loads(10, prefill_queue=None, local_queue=900), True),  # no prefill node: the decode node or nothing
    (Loads(10, prefill_queue=0, local_queue=None), False),  # no decode node can prefill
    (Loads(300, prefill_queue=0, local_queue=40, local_cached_tokens=240), True),  # 40 + the 60 it lacks
    (Loads(300, prefill_queue=0, local_queue=40, local_cached_tokens=239), False),  # 101
])
def test_auto_prefills_on_the_decode_node_when_its_share_is_small_or_the_pool_is_further_behind(loads, local):
    assert AUTO.local(loads) is local


def test_always_and_never_ignore_the_loads_unless_one_side_is_missing():
    always, never = (PrefillChoice(mode, max_local_tokens=100) for mode in (Disaggregation.ALWAYS, Disaggregation.NEVER))
    assert not always.local(Loads(1, prefill_queue=10_000, local_queue=0))
    assert never.local(Loads(10_000, prefill_queue=0, local_queue=10_000))
    assert always.local(Loads(1, prefill_queue=None, local_queue=0))  # no prefill node: the decode node can
    assert not never.local(Loads(1, prefill_queue=0, local_queue=None))  # none can: the orchestrator refuses


def stats(queued: int) -> node_pb2.NodeStats:
    return node_pb2.NodeStats(num_blocks=256, queued_prefill_tokens=queued)


@pytest.fixture
def cluster(tiny_llama):
    """An orchestrator over a registry with one prefill node and two decode nodes, one that can prefill."""
    def make(mode: str, local_queue: int = 0, prefill_queue: int = 0, tokens_per_s: float | None = None):
        registry = NodeRegistry(heartbeat_timeout_s=3.0, channel_close_grace_s=0.1, channel_factory=lambda _: None)
        registry.register(NodeKind.PREFILL, "127.0.0.1:7001", "p0")
        registry.register(NodeKind.DECODE, "127.0.0.1:7002", "d0")
        registry.register(NodeKind.DECODE, "127.0.0.1:7003", "d1", local_prefill=True)
        registry.heartbeat("p0", stats(prefill_queue))
        registry.heartbeat("d1", stats(local_queue))
        config = dataclasses.replace(RouterConfig(model=str(tiny_llama)), disaggregation=mode,
                                     local_prefill_max_tokens=64, local_prefill_tokens_per_s=tokens_per_s)
        state = RouterState(config, load_router_model(tiny_llama), registry, DecodePlacement(1.0),
                            PrefillPlacement(8, 0, 16))
        return registry, Orchestrator(state)
    return make


def test_the_route_follows_the_choice_and_the_local_route_takes_only_nodes_that_prefill(cluster):
    registry, router = cluster("auto", local_queue=30)
    local = router.choose_route([1] * 34)
    assert isinstance(local, LocalPrefillRoute)
    assert [e.node_id for e in registry.live(NodeKind.DECODE) if local.takes(e)] == ["d1"]
    assert isinstance(router.choose_route([1] * 35), DisaggregatedRoute)  # 30 queued + 35 > 64
    assert isinstance(cluster("always")[1].choose_route([1] * 1), DisaggregatedRoute)
    assert isinstance(cluster("never")[1].choose_route([1] * 10_000), LocalPrefillRoute)
    assert isinstance(cluster("auto", local_queue=0, prefill_queue=5_000)[1].choose_route([1] * 1_000), LocalPrefillRoute)


def test_never_without_a_decode_node_that_prefills_is_unavailable_naming_the_flag(cluster):
    registry, router = cluster("never")
    registry.mark_suspect(registry.get("d1"), "lost")  # the only decode node that prefills
    with pytest.raises(NoNodeAvailable) as err:
        router.choose_route([1] * 5)
    assert "--local-prefill" in str(err.value) and "--disaggregation never" in str(err.value)
    assert isinstance(cluster("auto")[1].choose_route([1] * 5), LocalPrefillRoute)


def test_a_bad_disaggregation_mode_or_bound_names_the_flag():
    with pytest.raises(ValueError, match="^disaggregation must be always, never or auto, got sometimes$"):
        RouterConfig(model="m", disaggregation="sometimes")
    with pytest.raises(ValueError, match="^local_prefill_max_tokens must be >= 0, got -1$"):
        RouterConfig(model="m", local_prefill_max_tokens=-1)
    with pytest.raises(ValueError, match="^local_prefill_tokens_per_s must be > 0, got 0$"):
        RouterConfig(model="m", local_prefill_tokens_per_s=0)


def test_a_prompt_whose_prefix_a_decode_node_imported_is_prefilled_there(cluster):
    """The decode node holds the first prompt's KV (imported through the pool, then cached), so a
    second prompt that extends it leaves only its new tokens to compute there (what `auto` weighs)."""
    registry, router = cluster("auto", local_queue=30)
    first = list(range(1, 49))  # 48 tokens: 30 queued + 48 > 64, so the prefill pool computes it
    route = router.choose_route(first)
    assert isinstance(route, DisaggregatedRoute)
    live = registry.live(NodeKind.DECODE)
    d1 = registry.get("d1").candidate()
    route.claim(d1, Load(len(first), 8, route.prefix(first, live)))  # the driver's claim on d1
    second = first + list(range(100, 120))  # 68 tokens, 20 of them new: 30 + 20 <= 64
    assert isinstance(router.choose_route(second), LocalPrefillRoute)
    assert isinstance(router.choose_route(list(range(200, 268))), DisaggregatedRoute)  # 68 new ones


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_prompt_budget_fills_at_its_rate_per_node_up_to_its_depth():
    clock = Clock()
    budget = PromptBudget(100.0, depth=200, clock=clock)
    assert budget.allows(200, nodes=1)  # full at the first look
    budget.take(150)
    assert budget.allows(50, nodes=1) and not budget.allows(51, nodes=1)
    clock.t = 0.5
    assert budget.allows(100, nodes=1) and not budget.allows(101, nodes=1)  # + 0.5 s x 100 tokens/s
    clock.t = 10.0
    assert budget.allows(200, nodes=1) and not budget.allows(201, nodes=1)  # capped at the depth
    budget.take(200)
    clock.t = 10.5
    assert budget.allows(100, nodes=2) and not budget.allows(101, nodes=2)  # two nodes: twice the rate
    assert PromptBudget(None, depth=200, clock=clock).allows(10**6, nodes=1)  # unset: no bound


def test_auto_keeps_its_decode_nodes_within_the_prompt_budget_and_charges_what_it_sends():
    """A budget of 100 tokens a second, as deep as the 200-token bound: short prompts go to the idle
    decode node until the budget is spent, then to the prefill pool, until it refills."""
    clock = Clock()
    hybrid = HybridRouting(PrefillChoice(Disaggregation.AUTO, max_local_tokens=200, local_tokens_per_s=100.0), clock)
    loads = Loads(80, prefill_queue=0, local_queue=0)
    assert [hybrid.local(loads) for _ in range(3)] == [True, True, False]  # 80 + 80; 40 left < 80
    clock.t = 0.4  # + 40 tokens: 80
    assert hybrid.local(loads)
    assert not hybrid.local(Loads(10, prefill_queue=0, local_queue=0))  # nothing left
    # Only the tokens the node lacks are charged, and a pool further behind does not lift the budget.
    clock.t = 2.4  # full again: 200
    assert hybrid.local(Loads(300, prefill_queue=0, local_queue=0, local_cached_tokens=120))  # 180 new
    assert not hybrid.local(Loads(30, prefill_queue=10_000, local_queue=0))  # 20 left
    # With a budget no prompt longer than the bound goes, however far behind the pool is.
    clock.t = 10.0
    assert not hybrid.local(Loads(201, prefill_queue=10_000, local_queue=0))
    # `never` and a cluster without a prefill node send the prompt to the decode node regardless.
    never = HybridRouting(PrefillChoice(Disaggregation.NEVER, 200, local_tokens_per_s=1.0), clock)
    assert all(never.local(Loads(500, prefill_queue=0, local_queue=0)) for _ in range(3))
    assert hybrid.local(Loads(500, prefill_queue=None, local_queue=0))


def test_the_router_reads_its_prompt_budget_from_its_config(cluster):
    registry, router = cluster("auto", local_queue=0, tokens_per_s=10.0)  # as deep as the 64-token bound
    assert isinstance(router.choose_route([1] * 40), LocalPrefillRoute)
    assert isinstance(router.choose_route([1] * 40), DisaggregatedRoute)  # 24 left; the router's clock barely moved


# -- decode nodes that prefill for the others (--serve-prefill) --------------------------------


@pytest.mark.parametrize("loads,local", [
    (Loads(500, prefill_queue=0, local_queue=0, pool_decodes=True), True),  # room here: no KV moves
    (Loads(10, prefill_queue=0, local_queue=900, pool_decodes=True), True),  # however long the queue
    (Loads(500, prefill_queue=0, local_queue=0, pool_decodes=True, kv_short=True), False),
], ids=["room-here", "queue-does-not-move-it", "short-of-kv-here"])
def test_auto_over_decode_nodes_that_prefill_moves_a_prompt_only_for_kv_room(loads, local):
    assert AUTO.local(loads) is local
    budgeted = dataclasses.replace(AUTO, local_tokens_per_s=1.0)
    assert budgeted.local(loads, within_budget=False) is local  # every node computes prompts: no budget


@pytest.fixture
def serve_prefill_pool(tiny_llama):
    """An orchestrator over two decode nodes started with --serve-prefill, `auto`."""
    registry = NodeRegistry(heartbeat_timeout_s=3.0, channel_close_grace_s=0.1, channel_factory=lambda _: None)
    for node_id, port in (("d0", 7002), ("d1", 7003)):
        registry.register(NodeKind.DECODE, f"127.0.0.1:{port}", node_id, serve_prefill=True)
    config = dataclasses.replace(RouterConfig(model=str(tiny_llama)), disaggregation="auto", block_size=8)
    state = RouterState(config, load_router_model(tiny_llama), registry, DecodePlacement(1.0), PrefillPlacement(8, 0, 16))
    return registry, Orchestrator(state)


def test_a_decode_node_that_serves_prefill_is_in_both_pools_once_each(serve_prefill_pool):
    registry, _ = serve_prefill_pool
    assert [e.node_id for e in registry.live(NodeKind.PREFILL)] == ["d0", "d1"]
    assert [e.node_id for e in registry.live(NodeKind.DECODE)] == ["d0", "d1"]
    assert all(e.local_prefill and e.kind is NodeKind.DECODE for e in registry.live(NodeKind.DECODE))


def test_auto_decodes_on_the_node_that_computes_the_prompt_unless_it_is_short_of_kv_and_another_is_not(
        serve_prefill_pool):
    registry, router = serve_prefill_pool
    registry.heartbeat("d0", node_pb2.NodeStats(num_blocks=64, used_blocks=40))
    registry.heartbeat("d1", node_pb2.NodeStats(num_blocks=64, used_blocks=0, queued_prefill_tokens=1))
    # d0 computes the prompt soonest (queue 0 against 1) and has 24 blocks free, d1 64.
    assert isinstance(router.choose_route([1] * 40, num_blocks=12), LocalPrefillRoute)  # 24 = twice 12
    assert isinstance(router.choose_route([1] * 40, num_blocks=13), DisaggregatedRoute)  # 24 < 26 <= 64
    assert isinstance(router.choose_route([1] * 40, num_blocks=33), LocalPrefillRoute)  # d1 is short too


class UsableNodes:
    """The one thing `DisaggregatedRoute.fed` asks of a sample: the nodes it may still use."""

    def __init__(self, registry: NodeRegistry, excluded: set[str]) -> None:
        self._registry, self._excluded = registry, excluded

    def usable(self, kind: NodeKind) -> list:
        return [e for e in self._registry.live(kind) if e.node_id not in self._excluded]


def test_a_serve_prefill_node_alone_is_never_fed_by_the_pool_route_so_a_resume_falls_back(serve_prefill_pool):
    registry, router = serve_prefill_pool
    registry.heartbeat("d0", node_pb2.NodeStats(num_blocks=64, used_blocks=40))
    registry.heartbeat("d1", node_pb2.NodeStats(num_blocks=64, used_blocks=0, queued_prefill_tokens=1))
    route = router.choose_route([1] * 40, num_blocks=13)  # d0 is short of KV: the pool route
    assert isinstance(route, DisaggregatedRoute)
    d0, d1 = registry.live(NodeKind.DECODE)
    both = UsableNodes(registry, excluded=set())
    assert route.fed(both, d0) and route.fed(both, d1)  # each feeds the other
    alone = UsableNodes(registry, excluded={"d0"})  # d0 lost during the sample
    assert not route.fed(alone, d1)  # d1 never feeds itself: the driver takes the local route

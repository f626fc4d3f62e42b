"""The whole cluster as discrete events: arrivals, the router's placement, every node's steps and
the KV hand-off, on one simulated clock.

Lifecycle of a request (as in docs/architecture.md §6 and the colocated route):
  colocated      arrival → the router ranks colocated nodes (`ColocatedPlacement`) → the first
                 that can ever hold it takes it → its steps stream tokens 1..n
  disaggregated  arrival → the router ranks decode nodes (`DecodePlacement`); the first with
                 room reserves the prompt's blocks, between two of its steps (its core loop reads
                 messages only there) → the router picks a prefill node
                 (`PrefillPlacement`) → chunked prefill; token 1 reaches the client when sampled
                 → the KV tail (the last chunk's blocks: earlier full blocks were pushed while
                 later chunks computed) moves in the profile's transfer time → the prefill node
                 frees its blocks, the decode node admits the request with token 1 and streams
                 tokens 2..n
  hybrid         a disaggregated cluster whose decode nodes also prefill (`--local-prefill`): the
                 router's `HybridRouting` (pdserve/router/dispatch/hybrid.py), fed the `Loads` the
                 orchestrator computes, picks per request; local: the decode nodes ranked by a
                 `ColocatedPlacement` over the decode pool's blocks (`LocalPrefillRoute`), the
                 request runs there as a colocated one (no KV moves); else disaggregated as above
  hybrid pool    decode nodes that are the prefill pool too (`--serve-prefill`): the same choice
                 (`Loads.pool_decodes`), and a disaggregated request's prompt computed on a node
                 other than its decode node, handed off at token 1 (`Request.hands_off`)
A request no node can take ends RESOURCE_EXHAUSTED, as the router answers it. The placement
policies are the router's own objects, given fresh stats at every decision (a real router sees
stats up to a heartbeat old plus what it sent since). The router itself, one process on one event
loop, is a first-come-first-served server: each request costs it `per_request_s` before placement
and each token `per_token_s` before the client has it (the profile's `RouterCost`), so a router
that cannot keep up delays every stream. On one machine the serving stack's CPU also comes out
of the cores the nodes run on: the router's, the node fronts' and (when the plan says the load
generator runs here) the client's CPU is charged as each request arrives and each token streams
(the profile's `ServingCosts`), a front's to its own node's cores, the router's and the client's
to the nodes with idle cores (of the pool they are pinned to, `ClusterSpec.stack_on`), and a step
takes longer while that load is high; the router's work in turn takes longer than its CPU time
while every node it may run on is busy (pdserve/planner/stack_load.py). Each KV push's CPU (the
profile's `TransferCost`, one push per chunk) is charged at the hand-off to the prefill node's and
the decode node's cores the same way. Nodes whose threads outnumber the machine's cores share
them as the OS does (`ClusterSpec.machine_cores`; pdserve/planner/core_sharing.py holds both ways
a step's profiled time becomes time on the clock). Not simulated: the network between client and
router, queue bounds, failures.

Each request's trace is the serving bench's `RequestTrace` (one chunk per token), so the bench's
metrics apply unchanged. Must never: read a wall clock or load torch.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.bench.serve.metrics import RequestTrace
from pdserve.engine.block_pool import BlockHash
from pdserve.engine.policy import ColocatedPolicy
from pdserve.engine.request import Request
from pdserve.planner.cluster_spec import ClusterSpec, Pool
from pdserve.planner.core_sharing import OwnCores, ProcessorSharing, StepTiming
from pdserve.planner.sim_node import PLACEHOLDER_TOKEN, Sampled, SimClock, SimNode
from pdserve.planner.stack_load import UTILISATION_WINDOW_S, CpuLoad, idle_weighted, router_slowdown, stretch
from pdserve.prefill_node.policy import PrefillPolicy
from pdserve.router.cluster.placement import Candidate, ColocatedPlacement, DecodePlacement, PrefillPlacement
from pdserve.router.cluster.prefix_affinity import PrefixAffinity
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch.hybrid import HybridRouting, Loads, PoolNode, local_loads, short_of_kv

EXHAUSTED = "RESOURCE_EXHAUSTED"
UNFINISHED = "UNFINISHED"  # still running when no event was left (a scheduler that can make no progress)


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    output_len: int


@dataclass(slots=True)
class _Flight:
    """One request in the cluster: its trace, and on a pair its decode side."""

    trace: RequestTrace
    decode_node: SimNode | None = None
    decode_request: Request | None = None


@dataclass(frozen=True, slots=True)
class _PairAsk:
    """A request of a pair looking for its decode reservation."""

    req_id: str
    prompt: list[int]
    hashes: tuple[BlockHash, ...]
    out_len: int
    trace: RequestTrace


class ClusterSim:
    def __init__(self, spec: ClusterSpec, max_model_len: int) -> None:
        self.clock = SimClock()
        self._spec = spec
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._stats_seq = itertools.count()
        # Every decision sees fresh stats (a new stats_seq, `placed_through` None: they show all
        # that was sent), so what the placements count of a stamp is gone by the next one.
        self._stamps = itertools.count(1)
        router = RouterConfig(model="", block_size=(spec.colocated or spec.decode).config.block_size)
        self._colocated_placement = ColocatedPlacement(router.exhausted_cooldown_s, self.clock.now,
                                                       affinity=PrefixAffinity.for_router(router))
        self._decode_placement = DecodePlacement(router.exhausted_cooldown_s, self.clock.now)
        self._prefill_placement = PrefillPlacement(router.block_size, router.affinity_slack_tokens,
                                                   router.max_affinity_entries)
        # As the orchestrator builds it: decode nodes that prefill, their blocks in the decode pool's.
        self._local_placement = ColocatedPlacement(router.exhausted_cooldown_s, self.clock.now,
                                                   blocks=self._decode_placement, affinity=PrefixAffinity.for_router(router))
        # The router's choice with its own prompt budget, on this run's clock.
        self._hybrid = None if spec.local_prefill is None else HybridRouting(spec.local_prefill, self.clock.now)
        self.colocated = self._nodes("colocated", spec.colocated, ColocatedPolicy(), max_model_len)
        self.prefill = self._nodes("prefill", spec.prefill, PrefillPolicy(), max_model_len)
        self.decode = self._nodes("decode", spec.decode, ColocatedPolicy(), max_model_len)
        # The nodes that compute prompts for a decode node: the prefill pool, or the decode nodes
        # themselves (--serve-prefill: each for the others, its prompts handed off at token 1).
        self._prefill_nodes = self.decode if spec.serve_prefill else self.prefill
        exporters = spec.decode if spec.serve_prefill else spec.prefill
        self._prefill_profile = exporters.profile if exporters is not None else None
        self._flights: dict[str, _Flight] = {}
        self._waiting_for_step_end: dict[SimNode, list[Callable[[], None]]] = {}
        self._router = spec.costs.router
        self._router_free_s = 0.0  # when the router has done all the work handed to it so far
        # The serving stack's CPU on the nodes' cores (pdserve/planner/stack_load.py): the router and the
        # client float to the idle ones; each node's front is pinned with it, to its cores.
        costs = spec.costs
        self._floating = CpuLoad(spec.node_cores)
        self._floating_per_request_s = costs.router.per_request_s + costs.client.per_request_s
        self._floating_per_token_s = costs.router.per_token_s + costs.client.per_token_s
        self._client = costs.client
        self._front = costs.fronts
        self._cores = {node: pool.cores_per_node
                       for pool, nodes in ((spec.colocated, self.colocated), (spec.prefill, self.prefill),
                                           (spec.decode, self.decode)) for node in nodes}
        # The nodes whose cores the router and the client run on: all, or the pool they are pinned to.
        hosts = list(self._cores) if spec.stack_on is None else getattr(self, spec.stack_on)
        self._stack_hosts = {node: i for i, node in enumerate(hosts)}  # node -> its place in idle_weighted's lists
        # Each node's CPU beside its steps, on its own cores: its front's, and its KV transport's
        # pushes (sent on a prefill node, taken in on a decode node; the profile's TransferCost).
        self._side_loads = {node: CpuLoad(cores) for node, cores in self._cores.items()}
        # The client alone, over the cores it shares with the router: what the router competes with.
        self._client_load = CpuLoad(sum(self._cores[n] for n in hosts))
        self._engine_loads = {node: CpuLoad(cores, UTILISATION_WINDOW_S) for node, cores in self._cores.items()}
        self._steps: StepTiming = (
            ProcessorSharing(spec.machine_cores, self._cores, self._stack_rate, self._router_rate, self._at,
                             self._step_done)
            if spec.shares_cores else OwnCores(self._stretch, self._own_cores_router_slowdown, self._at, self._step_done))

    def _nodes(self, kind: str, pool: Pool | None, policy, max_model_len: int) -> list[SimNode]:
        if pool is None:
            return []
        return [SimNode(f"{kind}-{i}", pool.config, pool.profile, policy, self.clock, max_model_len)
                for i in range(pool.count)]

    def run(self, requests: list[SimRequest]) -> list[RequestTrace]:
        traces = []
        for index, spec in enumerate(requests):
            trace = RequestTrace(index, spec.arrival_s, spec.output_len, len(spec.prompt_token_ids),
                                 sent_s=spec.arrival_s, request_id=f"r{index}")
            traces.append(trace)
            self._at(spec.arrival_s, lambda s=spec, t=trace: self._receive(s, t))
        while self._events:
            t, _, action = heapq.heappop(self._events)
            self.clock.t = t
            action()
        for trace in traces:
            if trace.end_s is None and trace.status == "OK":
                trace.status = UNFINISHED
        return traces

    def _at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), action))

    # ------------------------------------------------------------------ the router and placement

    def _router_work(self, cpu_s: float) -> float:
        """Hand the router `cpu_s` of CPU work now; when it is done (after what it already had), at
        the speed the busy cores it shares leave it (`router_slowdown`)."""
        start = max(self.clock.t, self._router_free_s)
        self._router_free_s = start + cpu_s * self._steps.router_slowdown(self.clock.t)
        return self._router_free_s

    def _own_cores_router_slowdown(self, now: float) -> float:
        client = self._client_load.share(now)
        return router_slowdown([self._engine_loads[n].share(now) + self._side_loads[n].share(now) + client
                                for n in self._stack_hosts])

    def _receive(self, spec: SimRequest, trace: RequestTrace) -> None:
        self._floating.charge(self.clock.t, self._floating_per_request_s)
        self._client_load.charge(self.clock.t, self._client.per_request_s)
        self._at(self._router_work(self._router.per_request_s), lambda: self._arrive(spec, trace))

    def _arrive(self, spec: SimRequest, trace: RequestTrace) -> None:
        req_id = trace.request_id
        prompt, out_len = list(spec.prompt_token_ids), spec.output_len
        # Hashed once for every placement: their affinities share the router's block size.
        hashes = self._local_placement.affinity.hashes(prompt)
        if self.colocated:
            self._place_colocated(self.colocated, self._colocated_placement, req_id, prompt, hashes, out_len, trace)
        elif self._hybrid is not None and self._hybrid.local(self._loads(prompt, hashes, out_len)):
            self._place_colocated(self.decode, self._local_placement, req_id, prompt, hashes, out_len, trace)
        else:
            self._place_pair(req_id, prompt, hashes, out_len, trace)

    def _loads(self, prompt: list[int], hashes: tuple[BlockHash, ...], out_len: int) -> Loads:
        """The orchestrator's `_loads`: the shortest prompt queue of each place this prompt could be
        computed, as each pool's placement counts it, and what the best decode node holds of it."""
        serve_prefill = self._spec.serve_prefill
        prefill = [PoolNode(n.node_id, self._prefill_placement.load(n.candidate(next(self._stats_seq))), serve_prefill)
                   for n in self._prefill_nodes]
        local = [n.candidate(next(self._stats_seq)) for n in self.decode]
        free = {c.node_id: self._decode_placement.free_after_reservations(c) for c in local}
        blocks = self.decode[0].kv.blocks_needed(len(prompt) + out_len) if self.decode else 0
        return local_loads(self._local_placement, len(prompt), hashes, prefill, local, short_of_kv(free, blocks))

    def _place_colocated(self, nodes: list[SimNode], placement: ColocatedPlacement, req_id: str, prompt: list[int],
                         hashes: tuple[BlockHash, ...], out_len: int, trace: RequestTrace) -> None:
        """The colocated route over `nodes`: colocated nodes, or decode nodes that prefill."""
        by_id = {n.node_id: n for n in nodes}
        for c in placement.rank([n.candidate(next(self._stats_seq)) for n in nodes], hashes):
            node = by_id[c.node_id]
            if not node.can_ever_hold(len(prompt), out_len):
                continue
            request = node.new_request(req_id, prompt, out_len)
            placement.assign(c, next(self._stamps), len(prompt), node.kv.blocks_needed(len(prompt)), hashes)
            self._flights[req_id] = _Flight(trace)
            self._front_takes(node)
            node.add(request)
            self._kick(node)
            return
        self._fail(trace, EXHAUSTED)

    def _place_pair(self, req_id: str, prompt: list[int], hashes: tuple[BlockHash, ...], out_len: int,
                    trace: RequestTrace) -> None:
        by_id = {n.node_id: n for n in self.decode}
        ranked = [(c, by_id[c.node_id])
                  for c in self._decode_placement.rank([n.candidate(next(self._stats_seq)) for n in self.decode])]
        self._ask_to_reserve(_PairAsk(req_id, prompt, hashes, out_len, trace), ranked)

    def _ask_to_reserve(self, ask: _PairAsk, ranked: list[tuple[Candidate, SimNode]]) -> None:
        """Ask the first of `ranked` that could ever hold the request; it answers between two of its
        steps, as a decode node's core loop reads its front's messages only then
        (pdserve/node/core/core_loop.py): a decode node in a long step (a hybrid one computing a prompt)
        holds up the prefill, which the router sends only once the node has reserved."""
        for position, (c, node) in enumerate(ranked):
            if node.can_ever_hold(len(ask.prompt), ask.out_len):
                self._between_steps(node, lambda: self._reserve(ask, c, node, ranked[position + 1:]))
                return
        self._fail(ask.trace, EXHAUSTED)

    def _reserve(self, ask: _PairAsk, c: Candidate, node: SimNode, rest: list[tuple[Candidate, SimNode]]) -> None:
        request = node.new_request(ask.req_id, ask.prompt, ask.out_len)
        if not node.reserve(request):  # no room now: the router asks the next node
            self._ask_to_reserve(ask, rest)
            return
        self._decode_placement.reserve(c, next(self._stamps), node.kv.blocks_needed(len(ask.prompt)))
        if self._hybrid is not None:  # as DisaggregatedRoute.claim: the node caches the prompt
            self._local_placement.affinity.remember(c.node_id, ask.hashes)
        self._flights[ask.req_id] = _Flight(ask.trace, node, request)
        self._front_takes(node)
        self._prefill(ask.req_id, ask.prompt, ask.trace)

    def _between_steps(self, node: SimNode, action: Callable[[], None]) -> None:
        """Run `action` at once if `node` is between steps, else when its step in progress ends."""
        if node.busy:
            self._waiting_for_step_end.setdefault(node, []).append(action)
        else:
            action()

    def _prefill(self, req_id: str, prompt: list[int], trace: RequestTrace) -> None:
        decode_node = self._flights[req_id].decode_node  # never computes its own prompt here
        able = [n for n in self._prefill_nodes if n is not decode_node and n.can_ever_hold(len(prompt), 1)]
        if not able:
            flight = self._flights.pop(req_id)
            flight.decode_node.kv.free(flight.decode_request)
            self._fail(trace, EXHAUSTED)
            return
        by_id = {n.node_id: n for n in able}
        chosen = self._prefill_placement.choose([n.candidate(next(self._stats_seq)) for n in able], prompt,
                                                next(self._stamps))
        node = by_id[chosen.node_id]
        self._front_takes(node)
        node.add(node.new_request(req_id, prompt, 1, hands_off=True))
        self._kick(node)

    # ------------------------------------------------------------------ steps

    def _kick(self, node: SimNode) -> None:
        if node.busy:
            return
        seconds = node.start_step()
        if seconds is not None:
            self._steps.start(node, seconds, self.clock.t)

    def _stretch(self, node: SimNode, now: float) -> float:
        """How much longer than its profiled time a step starting now takes on `node`'s own cores."""
        return stretch(self._floating_share(node, now), self._side_loads[node].share(now))

    def _stack_rate(self, now: float) -> float:
        """The router's, the client's and every node's side load (its front's, its KV pushes') at
        `now`, in cores."""
        return self._floating.rate(now) + sum(load.rate(now) for load in self._side_loads.values())

    def _router_rate(self, now: float) -> float:
        """The router's own CPU at `now`, in cores: the floating work less the client's."""
        return max(0.0, self._floating.rate(now) - self._client_load.rate(now))

    def _floating_share(self, node: SimNode, now: float) -> float:
        """`node`'s part of the router's and client's CPU, over its cores: none off the nodes they
        run on; on those, by each one's idle cores (its cores less its engine's and its front's
        share; `idle_weighted`)."""
        if node not in self._stack_hosts:
            return 0.0
        cores = [self._cores[n] for n in self._stack_hosts]
        idle = [c * max(0.0, 1.0 - self._engine_loads[n].share(now) - self._side_loads[n].share(now))
                for n, c in zip(self._stack_hosts, cores)]
        return idle_weighted(self._floating.rate(now), idle, cores)[self._stack_hosts[node]]

    def _step_done(self, node: SimNode, duration: float) -> None:
        """`node`'s step ended now, after `duration` on the clock."""
        now = self.clock.t
        self._engine_loads[node].charge(now, duration * self._cores[node])  # a step runs on all its cores
        for sampled in node.finish_step():
            if sampled.handoff_blocks is not None:
                self._hand_off(node, sampled, now)
                continue
            flight = self._flights[sampled.request.req_id]
            self._token(node, flight.trace, now, sampled.finished)
            if sampled.finished:
                del self._flights[sampled.request.req_id]
        for action in self._waiting_for_step_end.pop(node, ()):
            action()
        self._kick(node)

    def _hand_off(self, node: SimNode, sampled: Sampled, now: float) -> None:
        """Token 1 goes to the client now; the KV tail follows it to the decode node."""
        flight = self._flights[sampled.request.req_id]
        self._token(node, flight.trace, now, False)
        blocks = sampled.handoff_blocks
        pushed = sampled.computed_before // node.kv.block_size  # full before the last chunk: already sent
        profile = self._prefill_profile
        delay = profile.transfer.time((len(blocks) - pushed) * profile.kv_block_bytes)
        # Every push's CPU, the earlier chunks' included, charged now: both ends spend it around
        # the hand-off (the earlier pushes only shortly before).
        num_bytes = len(blocks) * profile.kv_block_bytes
        self._side_loads[node].charge(now, profile.transfer.send_cpu(sampled.pushes, num_bytes))
        self._side_loads[flight.decode_node].charge(now, profile.transfer.receive_cpu(sampled.pushes, num_bytes))
        self._at(now + delay, lambda: self._kv_arrived(node, blocks, flight))

    def _kv_arrived(self, prefill_node: SimNode, blocks, flight: _Flight) -> None:
        prefill_node.kv.pool.free(reversed(blocks))
        self._kick(prefill_node)  # freed blocks may let a waiting prompt in
        decode_node, request = flight.decode_node, flight.decode_request
        if decode_node.admit_prefilled(request, PLACEHOLDER_TOKEN):  # token 1 was its last
            flight.trace.end_s = flight.trace.chunks[-1][0]
            del self._flights[request.req_id]
            return
        self._kick(decode_node)

    # ------------------------------------------------------------------ outcomes

    def _front_takes(self, node: SimNode) -> None:
        """A request's leg is placed on `node`: its front's per-request CPU, on its cores."""
        self._side_loads[node].charge(self.clock.t, self._front.per_request_s)

    def _token(self, node: SimNode, trace: RequestTrace, now: float, last: bool) -> None:
        """`node` streamed a token; the client has it once the router has relayed it."""
        self._floating.charge(now, self._floating_per_token_s)
        self._client_load.charge(now, self._client.per_token_s)
        self._side_loads[node].charge(now, self._front.per_token_s)
        delivered = self._router_work(self._router.per_token_s)
        trace.chunks.append((delivered, 1))
        if last:
            trace.end_s = delivered

    @staticmethod
    def _fail(trace: RequestTrace, status: str) -> None:
        trace.status = status
        trace.end_s = trace.sent_s

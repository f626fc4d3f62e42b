"""One request's life: its n samples run side by side and share one response stream.

A validated request (seed already resolved, so every sample and node draws the same
stream) becomes n sample drivers (pdserve/router/dispatch/driver.py), sample_index 0..n-1, each with its
own token relay, all on the route this module picks when the request arrives: when any
colocated node is live, the colocated route (pdserve/router/dispatch/routes.py: one node runs both
phases — the baseline); otherwise the disaggregated route (a decode reservation, then a
prefill), which needs a live prefill and a live decode node, or, where decode nodes can also
prefill (`--local-prefill`), the local route to one of them when `--disaggregation`
(pdserve/router/dispatch/hybrid.py) says so. With none, the request is refused at once (UNAVAILABLE)
naming what is missing. The responses of the n samples
are multiplexed onto one stream in arrival order, each tagged with its `index`. A beam
search (`ValidatedRequest.beam`) is one driver instead, on the same routes, collecting the
node's beams (pdserve/router/requests/beam_results.py) rather than relaying tokens: it needs every
step's top logprobs of every beam in one engine, so it runs on a colocated node or a pair's
decode node, refused at once (FAILED_PRECONDITION naming beam_width) with neither; its beams
come back at its end, one response each.

Cancellation flows one way: when the caller stops iterating (client cancel, deadline,
an error in any sample), every sample task is cancelled, and each cancels its node
calls, so every node frees what it held. This module never picks a status code (it
raises `RouterError`s) and never touches a node's call itself.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from functools import partial

from pdserve.proto import pdserve_pb2
from pdserve.router.dispatch.asks import NodeAsks
from pdserve.router.dispatch.driver import SampleDriver
from pdserve.router.dispatch.hybrid import (
    Disaggregation, HybridRouting, Loads, PoolNode, PrefillChoice, local_loads, short_of_kv,
)
from pdserve.router.errors import NeedsNodes, NoNodeAvailable
from pdserve.router.requests.beam_results import BeamResults
from pdserve.router.requests.merge import Put, merged
from pdserve.router.requests.relay import TokenRelay
from pdserve.router.cluster.placement import ColocatedPlacement
from pdserve.router.cluster.prefix_affinity import PrefixAffinity
from pdserve.router.cluster.registry import NodeKind
from pdserve.router.dispatch.routes import ColocatedRoute, DisaggregatedRoute, LocalPrefillRoute, Route
from pdserve.router.dispatch.state import RouterState, SampleSpec
from pdserve.router.requests.validation import ValidatedRequest

log = logging.getLogger(__name__)


class Orchestrator:
    def __init__(self, state: RouterState) -> None:
        self.state = state
        self._router_id = uuid.uuid4().hex[:8]  # node request ids stay unique across routers
        self._sequence = itertools.count()
        config = state.config
        self._colocated = ColocatedRoute(ColocatedPlacement(config.exhausted_cooldown_s, state.clock,
                                                            affinity=PrefixAffinity.for_router(config)))
        # Decode nodes that also prefill: their blocks counted with the decode pool's reservations,
        # the prompts they hold (computed or imported) in one affinity both routes keep.
        self._local_placement = ColocatedPlacement(config.exhausted_cooldown_s, state.clock,
                                                   blocks=state.decode_placement, affinity=PrefixAffinity.for_router(config))
        self._local = LocalPrefillRoute(self._local_placement)
        choice = PrefillChoice(Disaggregation(config.disaggregation), config.local_prefill_max_tokens,
                               config.local_prefill_tokens_per_s)
        self._hybrid = HybridRouting(choice, state.clock)
        self._disaggregated = DisaggregatedRoute(state.decode_placement, state.prefill_placement,
                                                 config.ready_timeout_s, config.prefill_timeout_s,
                                                 local_affinity=self._local_placement.affinity)

    def generate(self, request: ValidatedRequest,
                 timeout_s: float | None) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        """Every sample's responses, as they come (the merged stream itself: no layer per response);
        raises the first sample's `RouterError`, a refusal of the route at once."""
        route = self.choose_route(request.prompt_token_ids, beam_search=request.beam is not None,
                                  num_blocks=request.max_kv_blocks(self.state.config.block_size,
                                                                   self.state.model.max_model_len))
        self.state.routes.count(route.name)
        received_at = self.state.clock()
        deadline = received_at + timeout_s if timeout_s is not None else None
        sequence = next(self._sequence)
        if request.beam is not None:
            specs = [SampleSpec(request, 0, f"{request.request_id}-beam-{self._router_id}{sequence}", received_at,
                                deadline)]
        else:
            specs = [SampleSpec(request, index, f"{request.request_id}-{index}-{self._router_id}{sequence}",
                                received_at, deadline) for index in range(request.params.n)]
        return merged([partial(self._run_sample, route, spec) for spec in specs])

    def choose_route(self, prompt_token_ids: Sequence[int], beam_search: bool = False, num_blocks: int = 0) -> Route:
        """Colocated nodes when any is live, else the disaggregated pools; refuse at once
        (UNAVAILABLE) when neither can serve, naming the kinds that are missing. `num_blocks`: the
        most KV blocks one sample may hold (what decoding it elsewhere would move)."""
        registry = self.state.registry
        if registry.live(NodeKind.COLOCATED):
            return self._colocated
        if self._hybrid.local(self._loads(prompt_token_ids, num_blocks)):
            return self._local
        if self._hybrid.choice.mode is Disaggregation.NEVER:
            raise NoNodeAvailable("no decode node started with --local-prefill is live, and no colocated node "
                                  "(--disaggregation never computes no prompt on the prefill pool)")
        missing = [kind.value for kind in (NodeKind.PREFILL, NodeKind.DECODE) if not registry.live(kind)]
        if missing and beam_search:
            raise NeedsNodes("beam_width", "beam_width: beam search runs on a colocated node or a prefill + decode "
                                           "pair (every step needs every beam's top logprobs in one engine), and "
                                           "this cluster has neither live")
        if missing:
            raise NoNodeAvailable(f"no {' and no '.join(missing)} node is available, and no colocated node; "
                                  "the cluster cannot serve")
        return self._disaggregated

    def _loads(self, prompt_token_ids: Sequence[int], num_blocks: int) -> Loads:
        """The shortest prompt queue of each place this request's prompt could be computed, what
        the decode node with the least to compute holds of it already, and whether that one is short
        of KV for the request's `num_blocks` while another decode node is not."""
        registry, state = self.state.registry, self.state
        prefill = [PoolNode(e.node_id, state.prefill_placement.load(e.candidate()), e.kind is NodeKind.DECODE)
                   for e in registry.live(NodeKind.PREFILL)]
        decode_nodes = registry.live(NodeKind.DECODE)
        decode = [e.candidate() for e in decode_nodes]
        local = [c for c, e in zip(decode, decode_nodes) if e.local_prefill]
        affinity = self._local_placement.affinity
        hashes = affinity.hashes(prompt_token_ids) if local and affinity is not None else ()
        free = {c.node_id: state.decode_placement.free_after_reservations(c) for c in decode}
        return local_loads(self._local_placement, len(prompt_token_ids), hashes, prefill, local,
                           short_of_kv(free, num_blocks))

    async def _run_sample(self, route: Route, spec: SampleSpec, put: Put) -> None:
        request, state = spec.request, self.state
        if request.beam is not None:
            sink, asks = BeamResults(request, state.model, put), NodeAsks.for_beam_search(request, state.model)
        else:
            sink = TokenRelay(request, spec.index, state.model, spec.received_at, state.clock, put)
            asks = NodeAsks.for_sample(request, spec.index, state.config.stream_interval)
        try:
            # A disaggregated sample whose pools run dry falls back to a decode node computing its
            # prompt itself, as choose_route would send a new request then.
            fallback = self._local if route is self._disaggregated else None
            await SampleDriver(state, route, spec, sink, asks, fallback).run()
        except Exception as exc:  # the stream's reader raises it (pdserve/router/requests/merge.py)
            log.debug("sample %s failed: %r", spec.node_req_id, exc)
            raise

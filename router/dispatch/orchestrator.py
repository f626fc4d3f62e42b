"""One request's life: its n samples run side by side and share one response stream.

A validated request (seed already resolved, so every sample and node draws the same
stream) becomes n sample drivers (router/dispatch/driver.py), sample_index 0..n-1, each with its
own token relay, all on the route this module picks when the request arrives: when any
colocated node is live, the colocated route (router/dispatch/routes.py: one node runs both
phases — the baseline); otherwise the disaggregated route (a decode reservation, then a
prefill), which needs a live prefill and a live decode node. With neither, the request
is refused at once (UNAVAILABLE) naming what is missing. The responses of the n samples
are multiplexed onto one stream in arrival order, each tagged with its `index`. A beam
search (`ValidatedRequest.beam`) runs once instead (router/dispatch/beam.py): on a colocated node when
one is live, else on a prefill + decode pair, refused at once (FAILED_PRECONDITION) with
neither; its beams come back at its end.

Cancellation flows one way: when the caller stops iterating (client cancel, deadline,
an error in any sample), every sample task is cancelled, and each cancels its node
calls, so every node frees what it held. This module never picks a status code (it
raises `RouterError`s) and never touches a node's call itself.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from functools import partial

from pdserve.proto import pdserve_pb2
from pdserve.router.dispatch.beam import BeamSearchRoute
from pdserve.router.dispatch.beam_pair import BeamSearchPair
from pdserve.router.dispatch.driver import SampleDriver
from pdserve.router.errors import NoNodeAvailable
from pdserve.router.requests.merge import Put, merged
from pdserve.router.cluster.placement import ColocatedPlacement
from pdserve.router.cluster.registry import NodeKind
from pdserve.router.dispatch.routes import ColocatedRoute, DisaggregatedRoute, Route
from pdserve.router.dispatch.state import RouterState, SampleSpec
from pdserve.router.requests.validation import ValidatedRequest

log = logging.getLogger(__name__)


class Orchestrator:
    def __init__(self, state: RouterState) -> None:
        self.state = state
        self._router_id = uuid.uuid4().hex[:8]  # node request ids stay unique across routers
        self._sequence = itertools.count()
        config = state.config
        colocated = ColocatedPlacement(config.exhausted_cooldown_s, state.clock)  # samples and beam searches alike
        self._colocated = ColocatedRoute(colocated)
        pair = BeamSearchPair(state.registry, state.decode_placement, state.prefill_placement, config.ready_timeout_s,
                              config.prefill_timeout_s, state.clock)
        self._beams = BeamSearchRoute(state.registry, colocated, state.model, config.block_size, pair,
                                      max_retries=config.max_resumes,
                                      max_node_failures=config.max_node_failures_per_request)
        self._disaggregated = DisaggregatedRoute(state.decode_placement, state.prefill_placement,
                                                 config.ready_timeout_s, config.prefill_timeout_s)

    async def generate(
        self, request: ValidatedRequest, timeout_s: float | None
    ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        """Every sample's responses, as they come; raises the first sample's `RouterError`."""
        if request.beam is not None:
            node_req_id = f"{request.request_id}-beam-{self._router_id}{next(self._sequence)}"
            for response in await self._beams.run(request, node_req_id, timeout_s):
                yield response
            return
        route = self._choose_route()
        received_at = self.state.clock()
        deadline = received_at + timeout_s if timeout_s is not None else None
        sequence = next(self._sequence)
        specs = [SampleSpec(request, index, f"{request.request_id}-{index}-{self._router_id}{sequence}", received_at,
                            deadline) for index in range(request.params.n)]
        async for response in merged([partial(self._run_sample, route, spec) for spec in specs]):
            yield response

    def _choose_route(self) -> Route:
        """Colocated nodes when any is live, else the disaggregated pools; refuse at once
        (UNAVAILABLE) when neither can serve, naming the kinds that are missing."""
        registry = self.state.registry
        if registry.live(NodeKind.COLOCATED):
            return self._colocated
        missing = [kind.value for kind in (NodeKind.PREFILL, NodeKind.DECODE) if not registry.live(kind)]
        if missing:
            raise NoNodeAvailable(f"no {' and no '.join(missing)} node is available, and no colocated node; "
                                  "the cluster cannot serve")
        return self._disaggregated

    async def _run_sample(self, route: Route, spec: SampleSpec, put: Put) -> None:
        try:
            await SampleDriver(self.state, route, spec, put).run()
        except Exception as exc:  # the stream's reader raises it (router/requests/merge.py)
            log.debug("sample %s failed: %r", spec.node_req_id, exc)
            raise

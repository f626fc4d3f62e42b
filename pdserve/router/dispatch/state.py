"""What the router's sample driver works from: the router-wide state and one sample's facts.

Owns `RouterState` (config, model, registry, the disaggregated pools' placements, the
counts of resumes and of routes, the clock: what every sample of every request shares) and `SampleSpec` (one sample of one
request, fixed when the request arrives). Plain data: it never calls a node and never
changes the registry or a placement.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from pdserve.common.enum_counts import EnumCounts
from pdserve.router.config import RouterConfig
from pdserve.router.model import RouterModel
from pdserve.router.cluster.placement import DecodePlacement, PlacementStamps, PrefillPlacement
from pdserve.router.cluster.registry import NodeRegistry
from pdserve.router.dispatch.recovery import ResumeCounts
from pdserve.router.requests.validation import ValidatedRequest


class PromptRoute(str, Enum):
    """Where a request's prompt is computed (each route's `name`, pdserve/router/dispatch/routes.py)."""

    COLOCATED = "colocated"
    PREFILL_POOL = "prefill_pool"  # the disaggregated route
    DECODE_NODE = "decode_node"  # a decode node started with --local-prefill


class RouteCounts(EnumCounts[PromptRoute]):
    """Requests by the route first chosen for them; one per router, read by its metrics at
    scrape time (`pdserve_prompt_routes_total`): what `--disaggregation auto` decides."""

    def __init__(self) -> None:
        super().__init__(PromptRoute)


@dataclass(frozen=True)
class RouterState:
    """What every sample of every request shares."""

    config: RouterConfig
    model: RouterModel
    registry: NodeRegistry
    decode_placement: DecodePlacement
    prefill_placement: PrefillPlacement
    stamps: PlacementStamps = field(default_factory=PlacementStamps)  # on every request sent to a node
    resumes: ResumeCounts = field(default_factory=ResumeCounts)
    routes: RouteCounts = field(default_factory=RouteCounts)
    clock: Callable[[], float] = field(default=time.monotonic)


@dataclass(frozen=True, slots=True)
class SampleSpec:
    request: ValidatedRequest
    index: int
    node_req_id: str  # unique per sample and per router, whatever id the client sent
    received_at: float
    deadline: float | None  # on the state's clock; None: the client set none

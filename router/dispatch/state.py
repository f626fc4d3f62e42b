"""What the router's sample driver works from: the router-wide state and one sample's facts.

Owns `RouterState` (config, model, registry, the disaggregated pools' placements, the
count of resumes, the clock: what every sample of every request shares) and `SampleSpec` (one sample of one
request, fixed when the request arrives). Plain data: it never calls a node and never
changes the registry or a placement.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.router.config import RouterConfig
from pdserve.router.model import RouterModel
from pdserve.router.cluster.placement import DecodePlacement, PrefillPlacement
from pdserve.router.cluster.registry import NodeRegistry
from pdserve.router.dispatch.recovery import ResumeCounts
from pdserve.router.requests.validation import ValidatedRequest


@dataclass(frozen=True)
class RouterState:
    """What every sample of every request shares."""

    config: RouterConfig
    model: RouterModel
    registry: NodeRegistry
    decode_placement: DecodePlacement
    prefill_placement: PrefillPlacement
    resumes: ResumeCounts = field(default_factory=ResumeCounts)
    clock: Callable[[], float] = field(default=time.monotonic)


@dataclass(frozen=True, slots=True)
class SampleSpec:
    request: ValidatedRequest
    index: int
    node_req_id: str  # unique per sample and per router, whatever id the client sent
    received_at: float
    deadline: float | None  # on the state's clock; None: the client set none

"""One request's life: its n samples run side by side and share one response stream.

A validated request (seed already resolved, so every sample and node draws the same
stream) becomes n sample drivers, sample_index 0..n-1, each with its own token relay.
Which driver depends on the nodes the registry has: when any colocated node is live,
`ColocatedRun`s (router/colocated.py: one node runs both phases — the baseline);
otherwise `SampleRun`s (router/sample.py: a decode reservation, then a prefill), which
need a live prefill and a live decode node. With neither, the request is refused at
once (UNAVAILABLE) naming what is missing. The responses of the n samples are
multiplexed onto one stream in arrival order, each tagged with its `index`.

Cancellation flows one way: when the caller stops iterating (client cancel, deadline,
an error in any sample), every sample task is cancelled, and each cancels its node
calls, so every node frees what it held. This module never picks a status code (it
raises `RouterError`s) and never touches a node's call itself.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from pdserve.proto import pdserve_pb2
from pdserve.router.colocated import ColocatedRun
from pdserve.router.errors import NoNodeAvailable
from pdserve.router.placement import ColocatedPlacement
from pdserve.router.registry import NodeKind
from pdserve.router.relay import Emit
from pdserve.router.sample import RouterState, SampleRun, SampleSpec
from pdserve.router.validation import ValidatedRequest

log = logging.getLogger(__name__)

_SAMPLE_DONE = object()


class SampleDriver(Protocol):
    """Drives one sample across the nodes until it ends; raises a `RouterError` if it cannot."""

    async def run(self) -> None: ...


DriverFactory = Callable[[SampleSpec, Emit], SampleDriver]


class Orchestrator:
    def __init__(self, state: RouterState) -> None:
        self.state = state
        self._router_id = uuid.uuid4().hex[:8]  # node request ids stay unique across routers
        self._sequence = itertools.count()
        self._colocated_placement = ColocatedPlacement(state.config.exhausted_cooldown_s, state.clock)

    async def generate(
        self, request: ValidatedRequest, timeout_s: float | None
    ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        """Every sample's responses, as they come; raises the first sample's `RouterError`."""
        driver = self._choose_driver()
        received_at = self.state.clock()
        deadline = received_at + timeout_s if timeout_s is not None else None
        queue: asyncio.Queue[object] = asyncio.Queue()
        sequence = next(self._sequence)
        tasks = []
        for index in range(request.params.n):
            node_req_id = f"{request.request_id}-{index}-{self._router_id}{sequence}"
            spec = SampleSpec(request, index, node_req_id, received_at, deadline)
            tasks.append(asyncio.create_task(self._run_sample(driver(spec, queue.put_nowait), spec, queue)))
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is _SAMPLE_DONE:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _choose_driver(self) -> DriverFactory:
        """Colocated nodes when any is live, else the disaggregated pools; refuse at once
        (UNAVAILABLE) when neither can serve, naming the kinds that are missing."""
        registry = self.state.registry
        if registry.live(NodeKind.COLOCATED):
            return lambda spec, emit: ColocatedRun(self.state, self._colocated_placement, spec, emit)
        missing = [kind.value for kind in (NodeKind.PREFILL, NodeKind.DECODE) if not registry.live(kind)]
        if missing:
            raise NoNodeAvailable(f"no {' and no '.join(missing)} node is available, and no colocated node; "
                                  "the cluster cannot serve")
        return lambda spec, emit: SampleRun(self.state, spec, emit)

    async def _run_sample(self, driver: SampleDriver, spec: SampleSpec, queue: asyncio.Queue[object]) -> None:
        try:
            await driver.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the stream's reader, which raises it
            log.debug("sample %s failed: %r", spec.node_req_id, exc)
            queue.put_nowait(exc)
            return
        queue.put_nowait(_SAMPLE_DONE)

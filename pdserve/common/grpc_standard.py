"""The standard gRPC services every pdserve server carries: `grpc.health.v1.Health` and reflection.

What a Kubernetes gRPC probe, `grpc_health_probe` or `grpcurl list` expect of any gRPC server:

- Health (grpcio-health-checking): the overall status ("") and each of the server's own services
  are SERVING exactly while the server's `serving()` check says so — a router while it can serve
  (a colocated node, or a prefill and a decode node, are live), a node while its engine core
  runs — except a service given a check of its own (`own_checks`): the router's Registry is
  SERVING while the router runs, nodes or none, which is what a liveness probe asks. `StandardServices` follows the check every `POLL_S` and whenever the server says it
  changed (`refresh`: the router on each registration; a Watch sees each change), and
  says NOT_SERVING for good once the server stops. Health answers without the auth token
  (pdserve/common/auth.py): a probe cannot send one, and the answer reveals only SERVING or not.
- Reflection (grpcio-reflection): the server's services, Health and reflection itself, so
  `grpcurl -plaintext HOST:PORT list` names them (behind the token when one is set).

Must never: import another pdserve part, or block the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

HEALTH_SERVICE = health.SERVICE_NAME  # "grpc.health.v1.Health"
POLL_S = 0.5


class StandardServices:
    def __init__(self, server: grpc.aio.Server, services: Sequence[str], serving: Callable[[], bool],
                 own_checks: Mapping[str, Callable[[], bool]] | None = None) -> None:
        """Add Health and reflection to `server` (before it starts); `services`: its own, by full
        name, each SERVING while `serving()` says so, or while its check in `own_checks` does."""
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection((*services, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
        own_checks = own_checks or {}
        self._checks = {name: own_checks.get(name, serving) for name in ("", *services)}
        self._statuses: dict[str, int] = {}
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Set the statuses now, then follow the check."""
        await self.refresh()
        self._task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        """NOT_SERVING from now on, whatever the check says (the server is going away)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._health.enter_graceful_shutdown()

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            await self.refresh()

    async def refresh(self) -> None:
        """Set the statuses from the checks now (the server calls it when it knows things changed)."""
        for name, check in self._checks.items():
            status = health_pb2.HealthCheckResponse.SERVING if check() else \
                health_pb2.HealthCheckResponse.NOT_SERVING
            if self._statuses.get(name) != status:
                self._statuses[name] = status
                await self._health.set(name, status)


def is_health_call(method: str) -> bool:
    """Does this full method name (`/package.Service/Method`) belong to the Health service?"""
    return method.startswith(f"/{HEALTH_SERVICE}/")

"""The real router server in-process on 127.0.0.1 (`running_router`), one bounded event loop per
scenario (`run`) and a client that collects a whole stream (`generate`).

Must never: leave the server running once the scenario ends, or run a scenario without a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import uvloop

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.fronts.server import RouterServer
from pdserve.router.model import RouterModel

TEST_TIMEOUT_S = 30.0


def run(coro):
    """Run one scenario on uvloop, bounded in time."""

    async def bounded():
        async with asyncio.timeout(TEST_TIMEOUT_S):
            return await coro

    return uvloop.run(bounded())


@contextlib.asynccontextmanager
async def running_router(model: tuple[str, RouterModel], **overrides) -> AsyncIterator[str]:
    """The real router server on an OS-picked port; yields its address. `model`: (folder, its loaded model)."""
    async with running_router_server(model, **overrides) as server:
        yield f"127.0.0.1:{server.port}"


@contextlib.asynccontextmanager
async def running_router_server(model: tuple[str, RouterModel], **overrides) -> AsyncIterator[RouterServer]:
    """As `running_router`, yielding the started server (its `port`, and its `http_port` with `http_port=0`)."""
    path, loaded = model
    server = RouterServer(RouterConfig(model=path, port=0, **overrides), loaded)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0)


async def generate(
    address: str, request: pdserve_pb2.GenerateRequest, timeout_s: float | None = None
) -> list[pdserve_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        return [r async for r in stub.Generate(request, timeout=timeout_s)]

"""Requests the fault and drain tests stream in the background while they kill or drain nodes."""

from __future__ import annotations

import asyncio
import random
import time

import grpc

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.testing.waiting import until


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 900) for _ in range(n)]


def greedy(ids: list[int], max_tokens: int) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=ids),
        sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


class Stream:
    """One streaming request in the background; what the client saw, token by token, and how it ended."""

    def __init__(self, router: str, request: pdserve_pb2.GenerateRequest, timeout_s: float = 120.0) -> None:
        self.tokens: list[int] = []
        self.responses: list[pdserve_pb2.GenerateResponse] = []
        self.error: grpc.aio.AioRpcError | None = None
        self.ended_at: float | None = None
        self._task = asyncio.create_task(self._run(router, request, timeout_s))

    @property
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.OK if self.error is None else self.error.code()

    @property
    def details(self) -> str:
        return "" if self.error is None else self.error.details() or ""

    async def _run(self, router: str, request: pdserve_pb2.GenerateRequest, timeout_s: float) -> None:
        async with grpc.aio.insecure_channel(router) as channel:
            try:
                async for response in pdserve_pb2_grpc.GenerationStub(channel).Generate(request, timeout=timeout_s):
                    self.responses.append(response)
                    self.tokens.extend(response.token_ids)
            except grpc.aio.AioRpcError as exc:
                self.error = exc
        self.ended_at = time.monotonic()

    async def until(self, predicate, timeout_s: float = 60.0) -> None:
        def reached() -> bool:
            assert not self._task.done() or predicate(), f"the stream ended early: {self.error}"
            return predicate()

        await until(reached, timeout_s, interval_s=0.02)

    async def done(self) -> Stream:
        await self._task
        return self

"""The open-loop driver: sends each request at its due time through a backend, which timestamps
every token.

Owns the schedule (a request is sent at its due time whether or not the earlier ones have
finished), the progress bar and `Backend`, the seam to a server's API: the gRPC API of a pdserve
router (pdserve/bench/serve/grpc_backend.py) or any OpenAI-compatible HTTP server
(pdserve/bench/serve/openai_backend.py), so pdserve and other servers are measured by the same
workloads, metrics and sweep. A backend records `time.perf_counter` at the send and at every
streamed token, seconds from the run's start; a failed call is recorded with its status code
and never stops the run. Never computes a metric; `metrics` does that from the traces.
"""

from __future__ import annotations

import asyncio
import ssl
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Protocol

from tqdm import tqdm

from pdserve.common.auth import call_metadata
from pdserve.common.tls import TlsConfig
from pdserve.bench.serve.metrics import RequestTrace
from pdserve.bench.serve.workloads import ModelLimits, RequestSpec

MODEL_INFO_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ClientOptions:
    timeout_s: float | None = None  # deadline of each request's whole stream
    auth_token: str | None = None  # sent as `authorization: Bearer <token>` on every call
    progress: bool = True  # a progress bar on stderr
    tls: TlsConfig | None = None  # TLS to the server, trusting its CA (pdserve/common/tls.py); None: plaintext

    def ssl_context(self) -> ssl.SSLContext | bool:
        """aiohttp's `ssl` argument: the CA's context with TLS, else its default checks."""
        return self.tls.client_ssl_context() if self.tls is not None else True

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return call_metadata(self.auth_token)


@dataclass(frozen=True)
class ServerModel:
    """What a server says of its model: the limits workloads are drawn within, and a record for the report."""

    limits: ModelLimits
    record: dict = field(default_factory=dict)


# One request's call: send `spec`, fill `trace` (times from `start`, a perf_counter reading).
Call = Callable[[RequestSpec, RequestTrace, float], Awaitable[None]]


class Backend(Protocol):
    options: ClientOptions

    async def model(self) -> ServerModel:
        """The served model's limits (raises the backend's own error when the server cannot say)."""
        ...

    def session(self) -> AbstractAsyncContextManager[Call]:
        """One run's connection to the server, and the call that sends one request over it."""
        ...


async def run_open_loop(backend: Backend, requests: list[RequestSpec], due_s: list[float],
                        label: str = "") -> list[RequestTrace]:
    """Send request i at due_s[i] seconds after the start; return every request's trace."""
    traces = [RequestTrace(index=i, due_s=due, expected_output_len=spec.output_len, input_len=spec.input_len)
              for i, (spec, due) in enumerate(zip(requests, due_s, strict=True))]
    async with backend.session() as call:
        with tqdm(total=len(requests), desc=label, unit="req", file=sys.stderr, disable=not backend.options.progress) as bar:
            async def one(spec: RequestSpec, trace: RequestTrace) -> None:
                await call(spec, trace, start)
                bar.update(1)

            start = time.perf_counter()
            calls = []
            for spec, trace in zip(requests, traces):
                delay = start + trace.due_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                calls.append(asyncio.create_task(one(spec, trace)))
            await asyncio.gather(*calls)
    return traces

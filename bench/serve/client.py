"""The open-loop gRPC driver: sends each request at its due time and timestamps every token.

Owns the channel to the router, the per-request call (`Generate`, a server stream) and
the trace of what came back: `time.perf_counter` at the send and at every response,
seconds from the run's start. A request is sent at its due time whether or not the
earlier ones have finished. A failed call is recorded with its gRPC status code and
never stops the run. Never computes a metric; `metrics` does that from the traces.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

import grpc
from tqdm import tqdm

from pdserve.common.auth import call_metadata
from pdserve.bench.serve.metrics import RequestTrace
from pdserve.bench.serve.workloads import ModelLimits, RequestSpec
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

MODEL_INFO_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ClientOptions:
    timeout_s: float | None = None  # deadline of each request's whole stream
    auth_token: str | None = None  # sent as `authorization: Bearer <token>` on every call
    progress: bool = True  # a progress bar on stderr

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return call_metadata(self.auth_token)


def generate_request(spec: RequestSpec) -> pdserve_pb2.GenerateRequest:
    """Greedy, exactly `output_len` tokens: `max_tokens` with `ignore_eos`."""
    params = pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True)
    if spec.token_ids is not None:
        return pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=spec.token_ids), sampling_params=params)
    return pdserve_pb2.GenerateRequest(text=spec.text, sampling_params=params)


async def fetch_model_info(address: str, options: ClientOptions) -> pdserve_pb2.ModelInfo:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pdserve_pb2_grpc.GenerationStub(channel).GetModelInfo(
            pdserve_pb2.GetModelInfoRequest(), timeout=MODEL_INFO_TIMEOUT_S, metadata=options.metadata()
        )


def model_limits(info: pdserve_pb2.ModelInfo) -> ModelLimits:
    return ModelLimits(info.vocab_size, info.max_model_len, tuple(info.eos_token_ids))


async def run_open_loop(
    address: str, requests: list[RequestSpec], due_s: list[float], options: ClientOptions, label: str = ""
) -> list[RequestTrace]:
    """Send request i at due_s[i] seconds after the start; return every request's trace."""
    traces = [RequestTrace(index=i, due_s=due, expected_output_len=spec.output_len, input_len=spec.input_len)
              for i, (spec, due) in enumerate(zip(requests, due_s, strict=True))]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        with tqdm(total=len(requests), desc=label, unit="req", file=sys.stderr, disable=not options.progress) as bar:
            start = time.perf_counter()
            calls = []
            for spec, trace in zip(requests, traces):
                delay = start + trace.due_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                calls.append(asyncio.create_task(_call(stub, spec, trace, start, options, bar)))
            await asyncio.gather(*calls)
    return traces


async def _call(stub, spec: RequestSpec, trace: RequestTrace, start: float, options: ClientOptions, bar) -> None:
    request = generate_request(spec)
    trace.sent_s = time.perf_counter() - start
    try:
        async for response in stub.Generate(request, timeout=options.timeout_s, metadata=options.metadata()):
            _record(trace, response, time.perf_counter() - start)
    except grpc.aio.AioRpcError as err:
        trace.status, trace.error = err.code().name, err.details() or ""
    except Exception as err:  # noqa: BLE001 - one broken call is a failed request, not a failed run
        trace.status, trace.error = grpc.StatusCode.UNKNOWN.name, f"{type(err).__name__}: {err}"
    trace.end_s = time.perf_counter() - start
    bar.update(1)


def _record(trace: RequestTrace, response: pdserve_pb2.GenerateResponse, at_s: float) -> None:
    trace.request_id = response.request_id
    if response.token_ids:
        trace.chunks.append((at_s, len(response.token_ids)))
    if response.HasField("usage"):
        trace.input_len = response.usage.prompt_tokens

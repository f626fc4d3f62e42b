"""The benchmark's backend for a pdserve router's gRPC API (`Generate`, a server stream).

Exact token counts: every response carries its token ids; a text prompt's length comes from
the response's usage.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import grpc

from pdserve.common.tls import aio_channel
from pdserve.bench.serve.client import MODEL_INFO_TIMEOUT_S, Call, ClientOptions, ServerModel
from pdserve.bench.serve.metrics import RequestTrace
from pdserve.bench.serve.workloads import ModelLimits, RequestSpec
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc


def generate_request(spec: RequestSpec) -> pdserve_pb2.GenerateRequest:
    """Greedy, exactly `output_len` tokens: `max_tokens` with `ignore_eos`."""
    params = pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True)
    if spec.token_ids is not None:
        return pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=spec.token_ids), sampling_params=params)
    return pdserve_pb2.GenerateRequest(text=spec.text, sampling_params=params)


async def fetch_model_info(address: str, options: ClientOptions) -> pdserve_pb2.ModelInfo:
    async with aio_channel(address, options.tls) as channel:
        return await pdserve_pb2_grpc.GenerationStub(channel).GetModelInfo(
            pdserve_pb2.GetModelInfoRequest(), timeout=MODEL_INFO_TIMEOUT_S, metadata=options.metadata()
        )


def model_limits(info: pdserve_pb2.ModelInfo) -> ModelLimits:
    return ModelLimits(info.vocab_size, info.max_model_len, tuple(info.eos_token_ids))


def model_record(info: pdserve_pb2.ModelInfo) -> dict:
    record = {field.name: getattr(info, field.name) for field in info.DESCRIPTOR.fields}
    record["eos_token_ids"] = list(info.eos_token_ids)  # a repeated field is no JSON list
    return record


class GrpcBackend:
    def __init__(self, address: str, options: ClientOptions) -> None:
        self.address = address
        self.options = options

    async def model(self) -> ServerModel:
        info = await fetch_model_info(self.address, self.options)
        return ServerModel(model_limits(info), {"backend": "grpc", "address": self.address, **model_record(info)})

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[Call]:
        async with aio_channel(self.address, self.options.tls) as channel:
            stub = pdserve_pb2_grpc.GenerationStub(channel)

            async def call(spec: RequestSpec, trace: RequestTrace, start: float) -> None:
                await _call(stub, spec, trace, start, self.options)
            yield call


async def _call(stub, spec: RequestSpec, trace: RequestTrace, start: float, options: ClientOptions) -> None:
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


def _record(trace: RequestTrace, response: pdserve_pb2.GenerateResponse, at_s: float) -> None:
    trace.request_id = response.request_id
    if response.token_ids:
        trace.chunks.append((at_s, len(response.token_ids)))
    if response.HasField("usage"):
        trace.input_len = response.usage.prompt_tokens

"""One sample's life across the cluster, as the router drives it.

    pick D ──Decode──▶ READY{descriptor, block ids}      (RESOURCE_EXHAUSTED: next D)
    pick P ──Prefill(descriptor, block ids)──▶ token 1   (the client sees it: TTFT)
    relay D's tokens 2..n ──▶ client                     (until D's finish, or a stop string)
    finally: cancel the D stream unless it ended          (D frees its blocks)

Owns the order of node calls and the mapping of node call failures to router errors;
what the client sees (text, stop strings, responses, usage, timings) is the sample's
`TokenRelay` (router/relay.py). It never multiplexes samples, never touches
the registry's lists beyond reading live nodes, and never retries a broken decode
stream (`_decode_lost` is the seam where resume will plug in).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2
from pdserve.router.config import RouterConfig
from pdserve.router.errors import NodeFailed, NoNodeAvailable, Overloaded, RouterError, from_node_error
from pdserve.router.model import RouterModel
from pdserve.router.placement import Candidate, DecodePlacement, PrefillPlacement
from pdserve.router.registry import NodeEntry, NodeKind, NodeRegistry
from pdserve.router.relay import TokenRelay
from pdserve.router.validation import ValidatedRequest
from pdserve.router.wire import params_to_proto


@dataclass(frozen=True)
class RouterState:
    """What every sample of every request shares."""

    config: RouterConfig
    model: RouterModel
    registry: NodeRegistry
    decode_placement: DecodePlacement
    prefill_placement: PrefillPlacement
    clock: Callable[[], float] = field(default=time.monotonic)


@dataclass(frozen=True, slots=True)
class SampleSpec:
    request: ValidatedRequest
    index: int
    node_req_id: str  # unique per sample and per router, whatever id the client sent
    received_at: float
    deadline: float | None  # on the state's clock; None: the client set none


class SampleRun:
    def __init__(self, state: RouterState, spec: SampleSpec, emit: Callable[[pdserve_pb2.GenerateResponse], None]):
        self._state = state
        self._spec = spec
        self._relay = TokenRelay(spec.request, spec.index, state.model, spec.received_at, state.clock, emit)

    async def run(self) -> None:
        decode_call = None
        try:
            decode_call, ready, decode_address = await self._reserve_decode()
            prefill = await self._run_prefill(ready)
            self._relay.prefill.add(prefill)
            logprobs = prefill.logprobs if prefill.HasField("logprobs") else None
            if self._relay.push_sampled_token(prefill.first_token_id, logprobs):
                return  # token 1 ended it: the finally cancels D's reservation
            await self._relay_decode(decode_call, decode_address)
        finally:
            if decode_call is not None:
                decode_call.cancel()  # no-op once the stream has ended

    # -- decode reservation -------------------------------------------------------------

    async def _reserve_decode(self) -> tuple[grpc.aio.UnaryStreamCall, node_pb2.Ready, str]:
        state = self._state
        live = state.registry.live(NodeKind.DECODE)
        if not live:
            raise NoNodeAvailable("no decode node is available")
        blocks = self._blocks_needed()
        refused: list[str] = []
        failure: RouterError | None = None
        for candidate in state.decode_placement.rank([e.candidate() for e in live]):
            entry = state.registry.get(candidate.node_id)
            if entry is None:
                continue
            try:
                call, ready = await self._ask_decode(entry, candidate, blocks)
                return call, ready, entry.address
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    state.decode_placement.mark_exhausted(candidate)
                    refused.append(entry.address)
                    continue
                failure = from_node_error("decode", entry.address, exc)
                if exc.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise failure from exc
        if failure is not None and not refused:
            raise failure
        nodes = ", ".join(refused) or "every decode node refused moments ago"
        raise Overloaded(f"no decode node can hold the request's KV cache ({blocks} blocks): {nodes}")

    async def _ask_decode(
        self, entry: NodeEntry, candidate: Candidate, blocks: int
    ) -> tuple[grpc.aio.UnaryStreamCall, node_pb2.Ready]:
        placement = self._state.decode_placement
        placement.reserve(candidate, blocks)
        stub = node_pb2_grpc.DecodeNodeStub(self._state.registry.channel(entry))
        call = stub.Decode(self._decode_request(), timeout=self._remaining())
        try:
            return call, await self._await_ready(call, entry.address)
        except BaseException:
            call.cancel()
            placement.reserve(candidate, -blocks)
            raise

    async def _await_ready(self, call: grpc.aio.UnaryStreamCall, address: str) -> node_pb2.Ready:
        timeout = self._bounded(self._state.config.ready_timeout_s)
        try:
            event = await asyncio.wait_for(call.read(), timeout)
        except TimeoutError as exc:
            raise NodeFailed(f"decode node {address} did not reserve blocks within {timeout:.1f}s") from exc
        if event is grpc.aio.EOF:
            raise NodeFailed(f"decode node {address} ended the stream before READY")
        if event.WhichOneof("event") != "ready":
            raise NodeFailed(f"decode node {address} sent {event.WhichOneof('event')} before READY")
        return event.ready

    def _decode_request(self) -> node_pb2.DecodeRequest:
        request = self._spec.request
        return node_pb2.DecodeRequest(
            request_id=self._spec.node_req_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=self._node_params(),
            seed=request.params.seed,
            sample_index=self._spec.index,
        )

    # -- prefill ------------------------------------------------------------------------

    async def _run_prefill(self, ready: node_pb2.Ready) -> node_pb2.PrefillResponse:
        state = self._state
        live = state.registry.live(NodeKind.PREFILL)
        if not live:
            raise NoNodeAvailable("no prefill node is available")
        prompt = self._spec.request.prompt_token_ids
        candidate = state.prefill_placement.choose([e.candidate() for e in live], prompt)
        entry = next(e for e in live if e.node_id == candidate.node_id)
        stub = node_pb2_grpc.PrefillNodeStub(state.registry.channel(entry))
        call = stub.Prefill(self._prefill_request(ready), timeout=self._bounded(state.config.prefill_timeout_s))
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            # A retry on another prefill node (D still holds its blocks) would plug in here.
            raise from_node_error("prefill", entry.address, exc) from exc
        finally:
            call.cancel()  # no-op once answered
            state.prefill_placement.finished(candidate, len(prompt))

    def _prefill_request(self, ready: node_pb2.Ready) -> node_pb2.PrefillRequest:
        request = self._spec.request
        return node_pb2.PrefillRequest(
            request_id=self._spec.node_req_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=self._node_params(),
            seed=request.params.seed,
            sample_index=self._spec.index,
            decode_kv_descriptor=ready.kv_descriptor,
            decode_block_ids=ready.block_ids,
        )

    # -- decode stream ------------------------------------------------------------------

    async def _relay_decode(self, call: grpc.aio.UnaryStreamCall, address: str) -> None:
        while True:
            try:
                event = await call.read()
            except grpc.aio.AioRpcError as exc:
                raise self._decode_lost(address, from_node_error("decode", address, exc)) from exc
            if event is grpc.aio.EOF:
                raise self._decode_lost(address, NodeFailed(f"decode node {address} ended the stream unfinished"))
            if event.WhichOneof("event") != "tokens":
                raise NodeFailed(f"decode node {address} sent a second READY")
            if self._relay.push_decoded(event.tokens):
                await self._await_end(call)
                return
            if self._relay.finished:
                return  # a stop string: the finally cancels D

    async def _await_end(self, call: grpc.aio.UnaryStreamCall) -> None:
        # The node's last event is in; let its stream close by itself rather than cancel it.
        try:
            await asyncio.wait_for(call.read(), self._state.config.stream_end_grace_s)
        except (TimeoutError, grpc.aio.AioRpcError):
            pass

    def _decode_lost(self, address: str, error: RouterError) -> RouterError:
        """The decode stream broke after READY. Resuming elsewhere (a new Decode with the prompt
        plus the tokens already streamed) plugs in here; for now the client gets the error."""
        return error

    # -- helpers ------------------------------------------------------------------------

    def _node_params(self) -> pdserve_pb2.SamplingParams:
        params = params_to_proto(self._spec.request.params)
        params.n = 1  # a node runs one sample; sample_index says which
        return params

    def _blocks_needed(self) -> int:
        request, model = self._spec.request, self._state.model
        tokens = min(len(request.prompt_token_ids) + request.params.max_tokens, model.max_model_len)
        return math.ceil(tokens / self._state.config.block_size)

    def _remaining(self) -> float | None:
        if self._spec.deadline is None:
            return None
        return max(0.0, self._spec.deadline - self._state.clock())

    def _bounded(self, limit_s: float) -> float:
        remaining = self._remaining()
        return limit_s if remaining is None else min(limit_s, remaining)

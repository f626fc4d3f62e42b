"""The gRPC servicers the node kinds share, and the checks every node request goes through.

`NodeServicer` answers `GetStats` for every kind (a snapshot from the engine core, or
its latest pushed one when the core is mid-step). `StreamServicer` is the whole service
of the two kinds whose requests stream tokens back: a decode node's `Decode` and a
colocated node's `Generate` take the same `SampleRequest` and answer the same
`DecodeEvent` stream (a decode node starts it with `ready`; a colocated node has no
KV to receive and streams token 1 too). A request's life through it:

    SampleRequest ─▶ checked (request_id, sampling params: INVALID_ARGUMENT) ─▶ StreamSubmit ─▶ core
    core ─Ready─▶ ready event (block ids, the layout's id);  ─Tokens─▶ tokens event (the last with
        finish_reason ends the call; the Tokens that wait in the request's inbox while the front
        sends go out as one event, and at a stream interval N about N to an event:
        pdserve/node/front/inbox.py)
    core ─BeamsDone─▶ beams event (a beam search: its one event ends the call)
    core ─RequestFailed─▶ the call fails with its code
    the call ends early (cancel, deadline, client gone) ─▶ Abort ─▶ core

A decode node's KV layout (every rank's address, block count, cache shape) is not in READY: READY
names it by id, and `GetKVLayout` answers it, as the core reported it at start, to a prefill node
that does not know that id yet (once per decode node run).

Must never: run model code, or choose a status code outside pdserve/node/errors.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured_output import library_loaded, load_library
from pdserve.node.front.client import CoreClient
from pdserve.node.front.convert import beams_to_proto, stats_to_proto, tokens_to_proto
from pdserve.proto.convert import params_from_proto
from pdserve.node.errors import ErrorCode, NodeError, abort_rpc
from pdserve.node.messages import BeamOption, BeamsDone, Ready, RequestFailed, StreamSubmit, Tokens
from pdserve.proto import node_pb2


class NodeServicer:
    """What every node kind's service answers alike."""

    def __init__(self, client: CoreClient) -> None:
        self.client = client

    async def GetStats(self, request: node_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> node_pb2.NodeStats:
        try:
            return stats_to_proto(await self.client.stats())
        except NodeError as exc:
            await abort_rpc(context, exc)


class StreamServicer(NodeServicer):
    """`DecodeNode` and `ColocatedNode` alike: one streamed request per call. `Decode`'s KV comes
    from a prefill node (the core's KV import stage takes it); `Generate`'s prompt is computed
    here (a colocated node, a decode node with --local-prefill)."""

    async def Decode(self, request: node_pb2.SampleRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[node_pb2.DecodeEvent]:
        async for event in self._stream(request, context, imports_kv=True):
            yield event

    async def GetKVLayout(self, request: node_pb2.KVLayoutRequest,
                          context: grpc.aio.ServicerContext) -> node_pb2.KVLayout:
        layout_id, layout = self.client.kv_layout
        if not layout_id:
            await abort_rpc(context, NodeError(ErrorCode.FAILED_PRECONDITION, "this node imports no KV"))
        return node_pb2.KVLayout(layout_id=layout_id, layout=layout.encode())

    async def Generate(self, request: node_pb2.SampleRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[node_pb2.DecodeEvent]:
        async for event in self._stream(request, context, imports_kv=False):
            yield event

    async def _stream(self, request: node_pb2.SampleRequest, context: grpc.aio.ServicerContext,
                      imports_kv: bool) -> AsyncIterator[node_pb2.DecodeEvent]:
        await grammar_library_ready(request)
        try:
            submit = stream_submit(request, imports_kv)
        except NodeError as exc:
            await abort_rpc(context, exc)
        async for event in _stream_events(self.client, context, submit, request.stream_interval):
            yield event


async def grammar_library_ready(request: node_pb2.SampleRequest | node_pb2.PrefillRequest) -> None:
    """Before a constrained request's params are built here the first time, the grammar library's
    import (seconds) runs in a thread, not on the loop every stream of this node shares."""
    if request.sampling_params.HasField("structured_output") and not library_loaded():
        await asyncio.to_thread(load_library)


def request_params(request: node_pb2.SampleRequest | node_pb2.PrefillRequest) -> SamplingParams:
    """The request's id checked and its sampling params converted; bad ones are INVALID_ARGUMENT."""
    if not request.request_id:
        raise NodeError(ErrorCode.INVALID_ARGUMENT, "request_id must not be empty")
    try:
        return params_from_proto(request.sampling_params, request.seed)
    except ValueError as exc:
        raise NodeError(ErrorCode.INVALID_ARGUMENT, f"sampling_params: {exc}") from exc


def stream_submit(request: node_pb2.SampleRequest, imports_kv: bool) -> StreamSubmit:
    """What the core gets for a decode or colocated node's request (params checked as above)."""
    params = request_params(request)
    beam = None
    if request.HasField("beam_search"):
        option = request.beam_search
        beam = BeamOption(option.beam_width, option.length_penalty if option.HasField("length_penalty") else 1.0)
    return StreamSubmit(req_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids), params=params,
                        sample_index=request.sample_index, resumed_token_ids=list(request.resumed_token_ids),
                        beam=beam, imports_kv=imports_kv, placement_stamp=request.placement_stamp)


async def _stream_events(client: CoreClient, context: grpc.aio.ServicerContext, submit: StreamSubmit,
                         stream_interval: int) -> AsyncIterator[node_pb2.DecodeEvent]:
    """A decode or colocated request's core messages as `DecodeEvent`s, until its last token;
    about one tokens event per `stream_interval` tokens (pdserve/node/front/inbox.py).

    A `RequestFailed` aborts the call with its code; a call that ends before the last
    token (cancel, deadline, a client gone) aborts the request in the core.
    """
    try:
        inbox = client.open_stream(submit.req_id, stream_interval)
    except NodeError as exc:
        await abort_rpc(context, exc)
    ended = False
    try:
        client.send(submit)
        while not ended:
            msg = await inbox.get()
            if isinstance(msg, RequestFailed):
                ended = True
                await abort_rpc(context, NodeError(msg.code, msg.message))
            if isinstance(msg, Ready):
                yield node_pb2.DecodeEvent(ready=node_pb2.Ready(kv_layout_id=msg.kv_layout_id,
                                                                block_ids=msg.block_ids))
            elif isinstance(msg, Tokens):
                ended = msg.finish_reason is not None
                yield node_pb2.DecodeEvent(tokens=tokens_to_proto(msg))
            elif isinstance(msg, BeamsDone):
                ended = True
                yield node_pb2.DecodeEvent(beams=beams_to_proto(msg))
            else:
                ended = True
                await abort_rpc(context, NodeError(ErrorCode.INTERNAL, f"unexpected {type(msg).__name__}"))
    finally:
        client.close_stream(submit.req_id)
        if not ended:
            client.abort(submit.req_id)

"""The prefill node's gRPC front: the `PrefillNode` service, the front of the KV export stage
(pdserve/prefill_node/kv_export.py); `pdserve prefill` runs it as a row of pdserve/node_kinds.py.

`Prefill(req)` hands the request to the engine core (which runs the prompt and pushes
its KV into the decode node's reserved blocks) and answers token 1 as soon as it is
sampled and the rest of the transfer is queued behind it (the KV follows token 1; a
transfer that fails afterwards fails the decode node's stream, and the router resumes). Cancelling the call aborts the request in the core.
The decode node's KV layout is named by id; the layout itself is fetched from the decode node once
per run of it (pdserve/prefill_node/layout_fetch.py) and given to the core with the first request naming it.

Must never: run model code, or choose a status code outside pdserve/node/errors.py.
"""

from __future__ import annotations

import grpc

from pdserve.node.front.client import CoreClient
from pdserve.proto.convert import logprobs_to_proto, prompt_logprobs_to_proto
from pdserve.node.errors import ErrorCode, NodeError, abort_rpc
from pdserve.node.messages import FirstToken, PrefillSubmit, RequestFailed
from pdserve.node.front.servicers import NodeServicer, grammar_library_ready, request_params
from pdserve.prefill_node.layout_fetch import LayoutCache, grpc_fetch
from pdserve.proto import node_pb2


class PrefillServicer(NodeServicer):
    def __init__(self, client: CoreClient) -> None:
        super().__init__(client)
        config = client.config
        self.layouts = LayoutCache(grpc_fetch(config.auth_token, config.kv_layout_timeout_s, config.tls))

    async def Prefill(self, request: node_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> node_pb2.PrefillResponse:
        await grammar_library_ready(request)
        try:
            submit = _submit(request)
            await self.layouts.ensure(request.decode_address, submit.kv_layout_id)
            inbox = self.client.open_stream(submit.req_id)
        except NodeError as exc:
            await abort_rpc(context, exc)
        answered = False
        try:
            try:  # no await between taking the layout and sending it: the core gets it first
                submit.kv_layout = self.layouts.take_unsent(request.decode_address, submit.kv_layout_id)
            except NodeError as exc:
                answered = True
                await abort_rpc(context, exc)
            self.client.send(submit)
            reply = await inbox.get()
            answered = True
            if isinstance(reply, RequestFailed):
                await abort_rpc(context, NodeError(reply.code, reply.message))
            if not isinstance(reply, FirstToken):
                await abort_rpc(context, NodeError(ErrorCode.INTERNAL, f"unexpected {type(reply).__name__}"))
            return _response(reply)
        finally:
            self.client.close_stream(submit.req_id)
            if not answered:
                self.client.abort(submit.req_id)


def _submit(request: node_pb2.PrefillRequest) -> PrefillSubmit:
    params = request_params(request)
    for name in ("decode_kv_layout_id", "decode_address"):
        if not getattr(request, name):
            raise NodeError(ErrorCode.INVALID_ARGUMENT, f"{name} must not be empty")
    return PrefillSubmit(req_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids), params=params,
                         sample_index=request.sample_index, kv_layout_id=request.decode_kv_layout_id,
                         dst_block_ids=list(request.decode_block_ids),
                         resumed_token_ids=list(request.resumed_token_ids),
                         placement_stamp=request.placement_stamp)


def _response(reply: FirstToken) -> node_pb2.PrefillResponse:
    response = node_pb2.PrefillResponse(first_token_id=reply.token_id, num_cached_tokens=reply.num_cached_tokens,
                                        prefill_s=reply.prefill_s, kv_transfer_s=reply.kv_transfer_s,
                                        kv_transfer_bytes=reply.kv_transfer_bytes)
    if reply.logprobs is not None:
        response.logprobs.CopyFrom(logprobs_to_proto(reply.token_id, reply.logprobs))
    if reply.prompt_logprobs is not None:
        response.prompt_logprobs.extend(prompt_logprobs_to_proto(reply.prompt_logprobs))
    return response

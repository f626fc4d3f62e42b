"""The decode node's gRPC front (`DecodeNode` service) and `pdserve decode`'s `main`.

`Decode(req)` streams: first `ready{kv_descriptor, block_ids}` once the core reserved
blocks for the prompt (or the call fails RESOURCE_EXHAUSTED at once), then `tokens`
events for tokens 2..n, the last with finish_reason. Cancelling the call aborts the
request in the core (a reservation whose KV has not arrived is freed there at once).

Must never: run model code, or choose a status code outside node/errors.py.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import grpc

from pdserve.node.client import CoreClient
from pdserve.node.convert import tokens_to_proto
from pdserve.node.core import CoreHooks
from pdserve.node.errors import ErrorCode, NodeError, abort_rpc
from pdserve.node.messages import DecodeSubmit, Ready, RequestFailed, Tokens
from pdserve.node.server import answer_stats, request_params, run_node
from pdserve.proto import node_pb2, node_pb2_grpc


class DecodeServicer(node_pb2_grpc.DecodeNodeServicer):
    def __init__(self, client: CoreClient) -> None:
        self.client = client

    async def Decode(self, request: node_pb2.DecodeRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[node_pb2.DecodeEvent]:
        try:
            submit = _submit(request)
            queue = self.client.open_stream(submit.req_id)
        except NodeError as exc:
            await abort_rpc(context, exc)
        ended = False
        try:
            self.client.send(submit)
            while True:
                msg = await queue.get()
                if isinstance(msg, RequestFailed):
                    ended = True
                    await abort_rpc(context, NodeError(msg.code, msg.message))
                if isinstance(msg, Ready):
                    yield node_pb2.DecodeEvent(ready=node_pb2.Ready(kv_descriptor=msg.kv_descriptor.encode(),
                                                                    block_ids=msg.block_ids))
                elif isinstance(msg, Tokens):
                    ended = msg.finish_reason is not None
                    yield node_pb2.DecodeEvent(tokens=tokens_to_proto(msg))
                    if ended:
                        return
                else:
                    ended = True
                    await abort_rpc(context, NodeError(ErrorCode.INTERNAL, f"unexpected {type(msg).__name__}"))
        finally:
            self.client.close_stream(submit.req_id)
            if not ended:
                self.client.abort(submit.req_id)

    async def GetStats(self, request: node_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> node_pb2.NodeStats:
        return await answer_stats(self.client, context)


def _submit(request: node_pb2.DecodeRequest) -> DecodeSubmit:
    params = request_params(request)
    return DecodeSubmit(req_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids), params=params,
                        sample_index=request.sample_index, resumed_token_ids=list(request.resumed_token_ids))


def _add_servicer(server: grpc.aio.Server, client: CoreClient) -> None:
    node_pb2_grpc.add_DecodeNodeServicer_to_server(DecodeServicer(client), server)


def main(argv: list[str] | None = None) -> int:
    return run_node(argv, "decode", CoreHooks("pdserve.decode_node.core"), _add_servicer)


if __name__ == "__main__":
    sys.exit(main())

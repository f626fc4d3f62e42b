"""The colocated node's gRPC front (`ColocatedNode` service) and `pdserve colocated`'s `main`.

`Generate(req)` streams `tokens` events for tokens 1..n as the engine core produces them,
the last with finish_reason; it fails RESOURCE_EXHAUSTED at once when the core cannot
take the request. `resumed_token_ids` (a resume after another node failed) are passed
to the core as output already generated. Cancelling the call aborts the request in the
core, which frees its blocks.

Must never: run model code, or choose a status code outside node/errors.py.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import grpc

from pdserve.engine.policy import ColocatedPolicy
from pdserve.node.client import CoreClient
from pdserve.node.core_part import CorePart
from pdserve.node.errors import NodeError, abort_rpc
from pdserve.node.server import answer_stats, decode_submit, run_node, stream_events
from pdserve.proto import node_pb2, node_pb2_grpc

CORE = CorePart(ColocatedPolicy, "pdserve.colocated_node.core:make_handler", uses_kv_transport=False)


class ColocatedServicer(node_pb2_grpc.ColocatedNodeServicer):
    def __init__(self, client: CoreClient) -> None:
        self.client = client

    async def Generate(self, request: node_pb2.DecodeRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[node_pb2.DecodeEvent]:
        try:
            submit = decode_submit(request)
        except NodeError as exc:
            await abort_rpc(context, exc)
        async for event in stream_events(self.client, context, submit):
            yield event

    async def GetStats(self, request: node_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> node_pb2.NodeStats:
        return await answer_stats(self.client, context)


def _add_servicer(server: grpc.aio.Server, client: CoreClient) -> None:
    node_pb2_grpc.add_ColocatedNodeServicer_to_server(ColocatedServicer(client), server)


def main(argv: list[str] | None = None) -> int:
    return run_node(argv, "colocated", CORE, _add_servicer)


if __name__ == "__main__":
    sys.exit(main())

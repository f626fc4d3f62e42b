"""The colocated node's gRPC front (`ColocatedNode` service) and `pdserve colocated`'s `main`.

`Generate(req)` streams `tokens` events for tokens 1..n as the engine core produces them,
the last with finish_reason; it fails RESOURCE_EXHAUSTED at once when the core cannot
take the request. `resumed_token_ids` (a resume after another node failed) are passed
to the core as output already generated. Cancelling the call aborts the request in the
core, which frees its blocks. The service is node/servicers.py's `StreamServicer`, the
decode node's too.

Must never: run model code, or choose a status code outside node/errors.py.
"""

from __future__ import annotations

import sys

import grpc

from pdserve.engine.policy import ColocatedPolicy
from pdserve.node.client import CoreClient
from pdserve.node.core_part import CorePart
from pdserve.node.server import run_node
from pdserve.node.servicers import StreamServicer
from pdserve.proto import node_pb2_grpc

CORE = CorePart(ColocatedPolicy, "pdserve.colocated_node.core:make_handler", uses_kv_transport=False)


def _add_servicer(server: grpc.aio.Server, client: CoreClient) -> None:
    node_pb2_grpc.add_ColocatedNodeServicer_to_server(StreamServicer(client), server)


def main(argv: list[str] | None = None) -> int:
    return run_node(argv, "colocated", CORE, _add_servicer)


if __name__ == "__main__":
    sys.exit(main())

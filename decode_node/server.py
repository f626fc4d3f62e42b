"""The decode node's gRPC front (`DecodeNode` service) and `pdserve decode`'s `main`.

`Decode(req)` streams: first `ready{kv_descriptor, block_ids}` once the core reserved
blocks for the prompt (or the call fails RESOURCE_EXHAUSTED at once), then `tokens`
events for tokens 2..n, the last with finish_reason. Cancelling the call aborts the
request in the core (a reservation whose KV has not arrived is freed there at once).
The service is node/servicers.py's `StreamServicer`, the colocated node's too.

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

# Requests join the scheduler prefilled, with token 1: the colocated rules only decode them.
CORE = CorePart(ColocatedPolicy, "pdserve.decode_node.core:make_handler")


def _add_servicer(server: grpc.aio.Server, client: CoreClient) -> None:
    node_pb2_grpc.add_DecodeNodeServicer_to_server(StreamServicer(client), server)


def main(argv: list[str] | None = None) -> int:
    return run_node(argv, "decode", CORE, _add_servicer)


if __name__ == "__main__":
    sys.exit(main())

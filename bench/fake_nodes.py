"""Fake prefill and decode nodes that answer at once: what is left to measure is the router.

    python -m pdserve.bench.fake_nodes --router HOST:PORT --model DIR

One process serves a prefill node and a decode node on 127.0.0.1 and registers both with the
router (the real Registry RPCs, with the fingerprint of a float32 node running the router's
model), heartbeating like real nodes. A request's token 1 comes from the fake prefill node, the
rest from the fake decode node, one token per event and no wait between them, once the prefill
has "pushed the KV" (an event in this process). The tokens cycle through a fixed sentence's ids,
so the router detokenizes real text. Their pools never fill: the router is the bottleneck.
Prints `ready` once both nodes are registered; runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
from collections import defaultdict

import grpc
import uvloop

from pdserve.kv_transfer.base import KV_LAYOUT_VERSION
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2
from pdserve.router.model import load_router_model

HEARTBEAT_S = 0.5
POOL_BLOCKS = 1 << 20
SENTENCE = " the router streams each token to its client as soon as the decode node sends it,"


class FastNodes(node_pb2_grpc.PrefillNodeServicer, node_pb2_grpc.DecodeNodeServicer):
    """Both fakes in one servicer: the prefill's KV push is an event the decode waits on."""

    def __init__(self, token_ids: list[int]) -> None:
        self._tokens = token_ids
        self._kv_done: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

    async def Prefill(self, request, context):
        self._kv_done[request.request_id].set()
        return node_pb2.PrefillResponse(first_token_id=self._tokens[0])

    async def Decode(self, request, context):
        yield node_pb2.DecodeEvent(ready=node_pb2.Ready(kv_layout_id="fake", block_ids=[0]))
        await self._kv_done[request.request_id].wait()
        del self._kv_done[request.request_id]
        count = request.sampling_params.max_tokens - 1
        tokens = itertools.islice(itertools.cycle(self._tokens[1:] + self._tokens[:1]), count)
        for i, token in enumerate(tokens, start=1):
            last = i == count
            yield node_pb2.DecodeEvent(tokens=node_pb2.DecodeTokens(
                token_ids=[token], stop_token_id=-1,
                finish_reason=pdserve_pb2.FINISH_REASON_LENGTH if last else pdserve_pb2.FINISH_REASON_UNSPECIFIED))

    async def GetStats(self, request, context):
        return node_pb2.NodeStats(num_blocks=POOL_BLOCKS)


async def serve(router: str, model_dir: str, block_size: int) -> None:
    model = load_router_model(model_dir)
    nodes = FastNodes(model.tokenizer.encode(SENTENCE, add_special_tokens=False))
    fingerprint = node_pb2.NodeFingerprint(
        model=model.name, dtype="float32", num_layers=model.num_layers, num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim, block_size=block_size, layout_version=KV_LAYOUT_VERSION)
    # One server per node: the registry knows a node by its address.
    servers = {"prefill": grpc.aio.server(), "decode": grpc.aio.server()}
    node_pb2_grpc.add_PrefillNodeServicer_to_server(nodes, servers["prefill"])
    node_pb2_grpc.add_DecodeNodeServicer_to_server(nodes, servers["decode"])
    addresses = {kind: f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}" for kind, server in servers.items()}
    for server in servers.values():
        await server.start()
    async with grpc.aio.insecure_channel(router) as channel:
        registry = node_pb2_grpc.RegistryStub(channel)
        joins = [node_pb2.RegisterRequest(kind=kind, address=address, node_id=f"fast-{kind}", fingerprint=fingerprint)
                 for kind, address in addresses.items()]
        for join in joins:
            await registry.Register(join, timeout=30)
        print("ready", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        while not stop.is_set():
            for join in joins:
                stats = node_pb2.NodeStats(kind=join.kind, num_blocks=POOL_BLOCKS)
                await registry.Heartbeat(node_pb2.HeartbeatRequest(node_id=join.node_id, stats=stats), timeout=5)
            await asyncio.wait([asyncio.ensure_future(stop.wait())], timeout=HEARTBEAT_S)
    for server in servers.values():
        await server.stop(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.fake_nodes", description=__doc__.splitlines()[0])
    p.add_argument("--router", required=True, help="router HOST:PORT to register with")
    p.add_argument("--model", required=True, help="the router's model directory (tokenizer + config)")
    p.add_argument("--block-size", type=int, default=16, help="the router's --block-size")
    args = p.parse_args(argv)
    uvloop.run(serve(args.router, args.model, args.block_size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

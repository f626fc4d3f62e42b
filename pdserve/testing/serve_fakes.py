"""Fake prefill and decode nodes that answer at once: what is left to measure is the router.

    python -m pdserve.testing.serve_fakes --router HOST:PORT --model DIR

One process serves a prefill node and a decode node on 127.0.0.1 (fake_nodes.py's servicers) and
registers both with the router (node_server.py: the real Registry RPCs, with the fingerprint of a
float32 node running the router's model), heartbeating like real nodes. A request's token 1 comes
from the fake prefill node, the rest from the fake decode node with no gap between events, once
the prefill has "pushed the KV". The decode node sends them as a real node front does at the
request's `stream_interval` N (pdserve/node/front/inbox.py): its first event one token, then N to an
event (the last what is left); at N = 1 (the router's default) one token per event, a front that
keeps up. The tokens cycle through a fixed sentence's ids, so the router detokenizes real text. Their pools
never fill: the router is the bottleneck.
Prints `ready` once both nodes are registered; runs until SIGTERM or SIGINT.

Must never: make the router wait on anything but the router's own work.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal

import uvloop

from pdserve.proto import node_pb2, pdserve_pb2
from pdserve.router.model import RouterModel, load_router_model
from pdserve.testing.fake_nodes import Calls, FakeDecode, FakePrefill, Script, decode_stats, prefill_stats
from pdserve.testing.node_server import FakeNode, ModelShape, started

HEARTBEAT_S = 0.5
POOL_BLOCKS = 1 << 20
SENTENCE = " the router streams each token to its client as soon as the decode node sends it,"


class AtOnce(Script):
    """Token 1 is the sentence's first; the decode streams the rest of `max_tokens`, cycling, in
    events as a real front sends them at the request's stream interval."""

    def __init__(self, token_ids: list[int]) -> None:
        super().__init__(first_token=lambda index: token_ids[0], event_gap_s=0.0)
        self.rest = token_ids[1:] + token_ids[:1]

    def events_for(self, request: node_pb2.SampleRequest) -> list[node_pb2.DecodeTokens]:
        tokens = list(itertools.islice(itertools.cycle(self.rest), request.sampling_params.max_tokens - 1))
        interval = max(1, request.stream_interval)
        starts = [0, *range(1, len(tokens), interval)] if tokens else []
        events = [node_pb2.DecodeTokens(token_ids=tokens[start:end], stop_token_id=-1)
                  for start, end in zip(starts, [*starts[1:], len(tokens)])]
        if events:
            events[-1].finish_reason = pdserve_pb2.FINISH_REASON_LENGTH
        return events


def at_once_nodes(router: str, model: RouterModel) -> tuple[Calls, list[FakeNode]]:
    """The prefill and the decode node, not started; one server each (the registry knows a node by its address)."""
    script = AtOnce(model.tokenizer.encode(SENTENCE, add_special_tokens=False))
    calls = Calls()
    shape = ModelShape(model.num_layers, model.num_kv_heads, model.head_dim)
    return calls, [
        FakeNode("prefill", FakePrefill(script, calls, prefill_stats(num_blocks=POOL_BLOCKS)), router,
                 "fast-prefill", shape=shape, heartbeat_s=HEARTBEAT_S),
        FakeNode("decode", FakeDecode(script, calls, decode_stats(POOL_BLOCKS, POOL_BLOCKS)), router,
                 "fast-decode", shape=shape, heartbeat_s=HEARTBEAT_S)]


async def serve(router: str, model_dir: str) -> None:
    _, nodes = at_once_nodes(router, load_router_model(model_dir))
    async with started(nodes):
        print("ready", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.testing.serve_fakes", description=__doc__.splitlines()[0])
    p.add_argument("--router", required=True, help="router HOST:PORT to register with")
    p.add_argument("--model", required=True, help="the router's model directory (tokenizer + config)")
    args = p.parse_args(argv)
    uvloop.run(serve(args.router, args.model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Fake prefill and decode nodes that answer at once: what is left to measure is the router.

    python -m pdserve.testing.serve_fakes --router HOST:PORT --model DIR [--tokens-per-event K]

One process serves a prefill node and a decode node on 127.0.0.1 (fake_nodes.py's servicers) and
registers both with the router (node_server.py: the real Registry RPCs, with the fingerprint of a
float32 node running the router's model), heartbeating like real nodes. A request's token 1 comes
from the fake prefill node, the rest from the fake decode node with no gap between events, once
the prefill has "pushed the KV". `--tokens-per-event` 1 (the default) is a node front that keeps
up: one token per event, as a real one sends while it sends each step's tokens before the next
step's come. K > 1 is a front K tokens behind: a real one joins the tokens waiting in a request's
inbox into one event (node/front/inbox.py), so each event carries K (the last one what is left).
The tokens cycle through a fixed sentence's ids, so the router detokenizes real text. Their pools
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
    """Token 1 is the sentence's first; the decode streams the rest of `max_tokens`, cycling,
    `tokens_per_event` per event (the last event what is left)."""

    def __init__(self, token_ids: list[int], tokens_per_event: int = 1) -> None:
        super().__init__(first_token=lambda index: token_ids[0], event_gap_s=0.0)
        self.rest = token_ids[1:] + token_ids[:1]
        self.tokens_per_event = tokens_per_event

    def events_for(self, request: node_pb2.SampleRequest) -> list[node_pb2.DecodeTokens]:
        tokens = list(itertools.islice(itertools.cycle(self.rest), request.sampling_params.max_tokens - 1))
        step = self.tokens_per_event
        events = [node_pb2.DecodeTokens(token_ids=tokens[i : i + step], stop_token_id=-1)
                  for i in range(0, len(tokens), step)]
        if events:
            events[-1].finish_reason = pdserve_pb2.FINISH_REASON_LENGTH
        return events


def at_once_nodes(router: str, model: RouterModel, tokens_per_event: int = 1) -> tuple[Calls, list[FakeNode]]:
    """The prefill and the decode node, not started; one server each (the registry knows a node by its address)."""
    script = AtOnce(model.tokenizer.encode(SENTENCE, add_special_tokens=False), tokens_per_event)
    calls = Calls()
    shape = ModelShape(model.num_layers, model.num_kv_heads, model.head_dim)
    return calls, [
        FakeNode("prefill", FakePrefill(script, calls, prefill_stats(num_blocks=POOL_BLOCKS)), router,
                 "fast-prefill", shape=shape, heartbeat_s=HEARTBEAT_S),
        FakeNode("decode", FakeDecode(script, calls, decode_stats(POOL_BLOCKS, POOL_BLOCKS)), router,
                 "fast-decode", shape=shape, heartbeat_s=HEARTBEAT_S)]


async def serve(router: str, model_dir: str, tokens_per_event: int) -> None:
    _, nodes = at_once_nodes(router, load_router_model(model_dir), tokens_per_event)
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
    p.add_argument("--tokens-per-event", type=int, default=1, metavar="K",
                   help="tokens per decode event: 1, a node front that keeps up; K > 1, one K tokens behind")
    args = p.parse_args(argv)
    if args.tokens_per_event < 1:
        p.error(f"--tokens-per-event must be at least 1, got {args.tokens_per_event}")
    uvloop.run(serve(args.router, args.model, args.tokens_per_event))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A fake colocated node (it runs both phases): streams scripted tokens, or a beam search's answer.

A sample gets the node's tokens after the ones it resumes from, in events of two, the last with
its finish reason. A node may refuse (RESOURCE_EXHAUSTED), die after some tokens (UNAVAILABLE),
or keep its stream open after the last event; its stats say how many prompt tokens it has queued,
which placement ranks it by. Every request it receives and every call the router cancels is
recorded on the node.

Must never: decide anything the router decides, or sleep where it waits for a condition.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2
from pdserve.testing.fake_nodes import EVENT_GAP_S, noting_cancel

LENGTH = pdserve_pb2.FINISH_REASON_LENGTH


def events_for(ids: list[int]) -> list[node_pb2.DecodeTokens]:
    """Tokens 1..n in events of two, the last with its finish reason."""
    events = [node_pb2.DecodeTokens(token_ids=ids[i : i + 2], stop_token_id=-1) for i in range(0, len(ids), 2)]
    events[-1].finish_reason = LENGTH
    return events


@dataclass
class FakeColocated(node_pb2_grpc.ColocatedNodeServicer):
    """Streams the tokens after the request's resumed ones; may refuse, die after some tokens, or hang."""

    output_ids: list[int]
    queued_tokens: int = 0  # what its stats say: placement asks the least queued node first
    refuse: bool = False
    die_after: int | None = None  # tokens streamed before the node "dies" (UNAVAILABLE)
    hang: bool = False  # keep the stream open after the last event
    beam_results: node_pb2.BeamResults | None = None  # the one event answering a beam search
    requests: list[node_pb2.SampleRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    @property
    def stats(self) -> node_pb2.NodeStats:
        # As a node's: they show the highest placement stamp it has taken in.
        placed = max((r.placement_stamp for r in self.requests), default=0)
        return node_pb2.NodeStats(kind="colocated", num_blocks=100, queued_prefill_tokens=self.queued_tokens,
                                  placed_through=placed)

    async def Generate(self, request, context):
        self.requests.append(request)
        with noting_cancel(lambda: self.cancelled.append(request.request_id)):
            if self.refuse:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fake colocated: queue full")
            sent = 0
            for event in self._events(request):
                if self.die_after is not None and sent >= self.die_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "fake colocated: node went away")
                await asyncio.sleep(EVENT_GAP_S)
                yield event
                sent += len(event.tokens.token_ids)
            if self.hang:
                await asyncio.Event().wait()

    def _events(self, request: node_pb2.SampleRequest) -> list[node_pb2.DecodeEvent]:
        if request.HasField("beam_search"):
            return [node_pb2.DecodeEvent(beams=self.beam_results)]
        remaining = self.output_ids[len(request.resumed_token_ids):]
        return [node_pb2.DecodeEvent(tokens=event) for event in events_for(remaining)]

    async def GetStats(self, request, context):
        return self.stats

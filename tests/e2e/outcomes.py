"""Helpers for the e2e tests of overload, deadlines, leases and cancellation.

A request's outcome as the client sees it (its final status and the responses that
came before), and the check every one of those tests ends with: no node holds a block.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import grpc

from pdserve.testing.waiting import settled
from tests.e2e.cluster import Cluster
from pdserve.proto import node_pb2, pdserve_pb2

IDLE_TIMEOUT_S = 15.0  # bounds the poll: a cancelled request's blocks are freed at once


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str = ""
    responses: list[pdserve_pb2.GenerateResponse] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [t for r in self.responses for t in r.token_ids]


def greedy_request(prompt: list[int], max_tokens: int) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=prompt),
        sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


async def outcome_of(call: grpc.aio.UnaryStreamCall) -> Outcome:
    """Read the call to its end; its status whatever it was (a cancelled call: CANCELLED)."""
    outcome = Outcome(grpc.StatusCode.OK)
    try:
        async for response in call:
            outcome.responses.append(response)
    except grpc.aio.AioRpcError as exc:
        outcome.code, outcome.details = exc.code(), exc.details() or ""
    except asyncio.CancelledError:  # grpc.aio's way of ending a call its own client cancelled
        outcome.code = grpc.StatusCode.CANCELLED
    return outcome


def wait_idle(cluster: Cluster, timeout_s: float = IDLE_TIMEOUT_S) -> list[node_pb2.NodeStats]:
    """Poll every node until none has a used or reserved block (or the time is up); the last stats."""
    return settled(cluster.stats, lambda stats: all(s.used_blocks == 0 and s.reserved_blocks == 0 for s in stats),
                   timeout_s)


def held_blocks(stats: list[node_pb2.NodeStats]) -> list[tuple[str, int, int]]:
    """(kind, used, reserved) per node: what a test asserts is all zeros."""
    return [(s.kind, s.used_blocks, s.reserved_blocks) for s in stats]


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 900) for _ in range(n)]


def greedy_params(max_tokens: int) -> pdserve_pb2.SamplingParams:
    return pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def decode_request(seed: int, req_id: str, tokens: list[int], max_tokens: int) -> node_pb2.SampleRequest:
    """A greedy SampleRequest as the router would send it, for tests that play the router."""
    return node_pb2.SampleRequest(request_id=req_id, prompt_token_ids=tokens, sampling_params=greedy_params(max_tokens),
                                  seed=seed)


def prefill_request(seed: int, req_id: str, tokens: list[int], max_tokens: int,
                    ready: node_pb2.Ready, decode_address: str) -> node_pb2.PrefillRequest:
    """The PrefillRequest that fills `ready`'s blocks on the decode node at `decode_address`."""
    return node_pb2.PrefillRequest(request_id=req_id, prompt_token_ids=tokens,
                                   sampling_params=greedy_params(max_tokens), seed=seed,
                                   decode_kv_layout_id=ready.kv_layout_id, decode_address=decode_address,
                                   decode_block_ids=ready.block_ids)

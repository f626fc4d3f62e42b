"""The one sample driver (pdserve/router/dispatch/driver.py) where a sample's stream opens, on both routes.

A node lost before its opening event (READY from a decode node, token 1 from a
colocated node) is skipped within the same attempt: the next ranked node gets the same
node request id and serves every token. Nodes that all refused moments ago (placement
skips them until their next stats) are RESOURCE_EXHAUSTED, on either route, like a
refusal now — never UNAVAILABLE, which means no node is there at all.
"""

from __future__ import annotations

import grpc
import pytest

from pdserve.proto import pdserve_pb2
from pdserve.testing.fake_colocated import FakeColocated
from pdserve.testing.node_server import colocated_nodes, fake_nodes
from pdserve.testing.router import generate, run
from pdserve.testing.router import running_router as router
from tests.unit.test_router_colocated import request as colocated_request
from tests.unit.test_router_fake_nodes import scripted, text_request

# Long enough that no refusal is forgotten by the clock during a test: only fresh stats clear one.
COOLDOWN = dict(exhausted_cooldown_s=600.0, heartbeat_timeout_s=600.0)


@pytest.fixture(scope="module")
def output_ids(router_model) -> list[int]:
    ids = router_model[1].tokenizer.encode(" the quick brown fox jumps over")
    assert 0 not in ids and len(ids) >= 6  # 0 is the tiny model's eos
    return ids


async def status_of(address: str, request: pdserve_pb2.GenerateRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(address, request)
    return err.value


def test_a_decode_node_lost_before_ready_hands_the_attempt_to_the_next(router_model, output_ids):
    async def scenario():
        async with router(router_model) as address, fake_nodes(address, scripted(output_ids), decode=2) as (calls, nodes):
            dying, healthy = nodes[1].servicer, nodes[2].servicer  # equal free blocks: "d0" is asked first
            dying.fail_before_ready = True
            return await generate(address, text_request(max_tokens=len(output_ids))), dying, healthy, calls

    responses, dying, healthy, calls = run(scenario())
    assert [t for r in responses for t in r.token_ids] == output_ids
    [lost], [served] = dying.requests, healthy.requests
    assert served.request_id == lost.request_id and not served.resumed_token_ids  # the same attempt
    assert [r.request_id for r in calls.prefill_requests] == [served.request_id]


def test_a_colocated_node_lost_before_its_first_token_hands_the_attempt_to_the_next(router_model, output_ids):
    dying = FakeColocated(output_ids, queued_tokens=0, die_after=0)  # ranked first, dies before any token
    healthy = FakeColocated(output_ids, queued_tokens=500)

    async def scenario():
        async with router(router_model) as address, colocated_nodes(address, dying, healthy):
            return await generate(address, colocated_request(len(output_ids)))

    responses = run(scenario())
    assert [t for r in responses for t in r.token_ids] == output_ids
    [lost], [served] = dying.requests, healthy.requests
    assert served.request_id == lost.request_id and not served.resumed_token_ids


def test_decode_nodes_that_refused_moments_ago_are_resource_exhausted(router_model, output_ids):
    async def scenario():
        async with router(router_model, **COOLDOWN) as address, \
                fake_nodes(address, scripted(output_ids, refuse_decode=True)) as (calls, nodes):
            await nodes[1].stop_heartbeats()  # its refusal then stands: no fresh stats clear it
            now = await status_of(address, text_request(max_tokens=len(output_ids)))
            moments_ago = await status_of(address, text_request(max_tokens=len(output_ids)))
            return now, moments_ago, calls

    now, moments_ago, calls = run(scenario())
    assert now.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert now.details().startswith("no decode node can take the request (")
    assert moments_ago.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert moments_ago.details().endswith(": every decode node refused moments ago")
    assert len(calls.decode_requests) == 1 and not calls.prefill_requests  # the second was never sent


def test_colocated_nodes_that_refused_moments_ago_are_resource_exhausted(router_model, output_ids):
    full = FakeColocated(output_ids, refuse=True)

    async def scenario():
        async with router(router_model, **COOLDOWN) as address, colocated_nodes(address, full) as nodes:
            await nodes[0].stop_heartbeats()
            now = await status_of(address, colocated_request(len(output_ids)))
            moments_ago = await status_of(address, colocated_request(len(output_ids)))
            return now, moments_ago

    now, moments_ago = run(scenario())
    assert now.code() is moments_ago.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert moments_ago.details().endswith(": every colocated node refused moments ago")
    assert len(full.requests) == 1

"""No request waits on a silent node: a frozen node's samples move once the registry drops it.

A frozen fake node keeps its streams open and answers nothing more (its heartbeats stop,
its stream hangs), the way a SIGSTOPped process does. The real router (short heartbeat
timeout) drops it and the sample goes on elsewhere: exact tokens, no gap, no duplicate.
"""

from __future__ import annotations

import asyncio

import pytest

from pdserve.proto import node_pb2
from pdserve.router.cluster.liveness import GoneWatch, NodeGone, unless_gone
from pdserve.router.cluster.registry import NodeEntry, NodeKind, NodeRegistry
from pdserve.testing.node_server import fake_nodes
from pdserve.testing.router import run
from pdserve.testing.router import running_router as router
from pdserve.testing.waiting import until
from tests.unit.test_router_fake_nodes import collect, resumable, text_request

FAST_DROP = dict(heartbeat_timeout_s=0.5, maintenance_interval_s=0.05)


@pytest.fixture(scope="module")
def output_ids(router_model) -> list[int]:
    return router_model[1].tokenizer.encode(" the quick brown fox jumps over")


def test_a_frozen_decode_node_mid_stream_is_resumed_on_another(router_model, output_ids):
    script = resumable(output_ids, hang_after_events=True)
    script.decode_events = lambda index: [node_pb2.DecodeTokens(token_ids=[output_ids[1]])]

    async def scenario():
        async with router(router_model, **FAST_DROP) as address, fake_nodes(address, script, decode=2) as (calls, nodes):
            frozen = nodes[1]  # d0: ranked first (a tie in free blocks goes by id)
            so_far: list = []
            client = asyncio.create_task(collect(address, text_request(max_tokens=len(output_ids)), so_far))
            await until(lambda: sum(len(r.token_ids) for r in so_far) >= 2, 30)
            await frozen.stop_heartbeats()  # its stream already hangs: now it is silent too
            received, error = await asyncio.wait_for(client, 30)
            cancelled = await asyncio.wait_for(calls.wait_cancelled("decode", calls.decode_requests[0].request_id), 30)
            return received, error, calls, cancelled

    received, error, calls, _ = run(scenario())
    assert error is None
    assert [t for r in received for t in r.token_ids] == output_ids  # no gap, no duplicate
    resumed = [r for r in calls.decode_requests if r.resumed_token_ids]
    assert [list(r.resumed_token_ids) for r in resumed] == [output_ids[:2]]
    assert resumed[0].request_id.endswith("~1")


def test_a_frozen_prefill_node_is_retried_on_another(router_model, output_ids):
    script = resumable(output_ids)

    async def scenario():
        async with router(router_model, **FAST_DROP) as address, fake_nodes(address, script, prefill=2) as (calls, nodes):
            frozen = nodes[0]
            frozen.servicer.hang = True  # answers no Prefill
            await frozen.stop_heartbeats()
            received, error = await asyncio.wait_for(collect(address, text_request(max_tokens=len(output_ids))), 30)
            return received, error, calls

    received, error, calls = run(scenario())
    assert error is None
    assert [t for r in received for t in r.token_ids] == output_ids


def test_a_prefill_node_gone_after_token_one_before_its_kv_landed_is_resumed(router_model, output_ids):
    # Token 1 leaves the prefill node when it is sampled; the rest of its KV may still be on its
    # way. p0 answers token 1 and then goes silent with the KV undelivered: the decode stream
    # would wait for it until the reservation's lease, so the sample resumes once p0 is dropped.
    script = resumable(output_ids)

    async def scenario():
        async with router(router_model, **FAST_DROP) as address, fake_nodes(address, script, prefill=2) as (calls, nodes):
            nodes[0].servicer.withhold_kv = True
            nodes[1].servicer.refuse = True  # the first attempt goes to p0
            client = asyncio.create_task(collect(address, text_request(max_tokens=len(output_ids))))
            await until(lambda: calls.prefill_requests, 30)
            nodes[1].servicer.refuse = False
            await nodes[0].stop_heartbeats()
            return await asyncio.wait_for(client, 30), calls

    (received, error), calls = run(scenario())
    assert error is None
    assert [t for r in received for t in r.token_ids] == output_ids  # token 1 once, then the rest
    assert [list(r.resumed_token_ids) for r in calls.prefill_requests if r.resumed_token_ids] == \
        [output_ids[:1]]


def test_kv_that_never_lands_after_token_one_is_a_lost_transfer_not_the_clients_deadline(router_model, output_ids):
    # p0 stays healthy but its transfer fails after token 1 (the KV never lands): the decode
    # node's reservation lease ends the stream DEADLINE_EXCEEDED. The client's deadline is far
    # away, so the router resumes the sample (token 1 already streamed) instead of failing it.
    script = resumable(output_ids)

    async def scenario():
        async with router(router_model) as address, fake_nodes(address, script, prefill=2) as (calls, nodes):
            nodes[0].servicer.withhold_kv = True
            nodes[2].servicer.lease_s = 0.3
            received, error = await asyncio.wait_for(
                collect(address, text_request(max_tokens=len(output_ids))), 30)
            return received, error, calls

    received, error, calls = run(scenario())
    assert error is None
    assert [t for r in received for t in r.token_ids] == output_ids
    assert [list(r.resumed_token_ids) for r in calls.decode_requests] == [[], output_ids[:1]]


# -- the seam itself ------------------------------------------------------------------------


def test_unless_gone_returns_the_result_while_every_node_is_there():
    entry = NodeEntry("d0", NodeKind.DECODE, "127.0.0.1:1", static=False)

    async def scenario():
        return await unless_gone(asyncio.sleep(0, result="event"), [entry])

    assert run(scenario()) == "event"


def test_unless_gone_ends_a_silent_wait_when_the_registry_drops_its_node():
    now = [0.0]
    registry = NodeRegistry(heartbeat_timeout_s=5.0, channel_close_grace_s=0.1, clock=lambda: now[0])

    async def scenario():
        entry = registry.register(NodeKind.DECODE, "127.0.0.1:1", "d0")
        forever = asyncio.Event()
        waiting = asyncio.create_task(unless_gone(forever.wait(), [entry]))
        await asyncio.sleep(0)
        now[0] = 5.5  # silent past the timeout
        assert registry.expire() == [entry]
        try:
            await asyncio.wait_for(waiting, 5)
        except NodeGone as gone:
            return gone
        return None

    gone = run(scenario())
    assert gone is not None and gone.entry.node_id == "d0"
    assert str(gone) == "decode node d0 is gone: 127.0.0.1:1 was silent for 5.5s (no heartbeat or stats)"


def test_a_node_registering_again_ends_the_waits_on_its_old_process():
    registry = NodeRegistry(heartbeat_timeout_s=5.0, channel_close_grace_s=0.1)

    async def scenario():
        old = registry.register(NodeKind.DECODE, "127.0.0.1:1", "d0")
        registry.register(NodeKind.DECODE, "127.0.0.1:1", "d0")  # restarted on the same address
        try:
            await unless_gone(asyncio.Event().wait(), [old])
        except NodeGone as gone:
            return str(gone)

    assert run(scenario()) == "decode node d0 is gone: 127.0.0.1:1 registered again (a new process)"


def test_a_stream_watch_returns_each_result_and_ends_the_wait_its_node_leaves():
    # One watch for a whole stream: every await gets its result while the nodes are there; a
    # node no longer depended on (forgotten) ends nothing; the stream's own node, gone while
    # an await waits, ends that await with NodeGone.
    stream_node = NodeEntry("d0", NodeKind.DECODE, "127.0.0.1:1", static=False)
    feeder = NodeEntry("p0", NodeKind.PREFILL, "127.0.0.1:2", static=False)

    async def scenario():
        with GoneWatch([stream_node, feeder]) as watch:
            results = [await watch.until(asyncio.sleep(0, result=i)) for i in range(3)]
            watch.forget([feeder])
            feeder.gone.set()
            results.append(await watch.until(asyncio.sleep(0.05, result="after the feeder left")))
            waiting = asyncio.ensure_future(watch.until(asyncio.Event().wait()))
            await asyncio.sleep(0)
            stream_node.gone_reason = "registered again (a new process)"
            stream_node.gone.set()
            try:
                await asyncio.wait_for(waiting, 5)
            except NodeGone as gone:
                return results, gone.entry.node_id
        return results, None

    assert run(scenario()) == ([0, 1, 2, "after the feeder left"], "d0")


def test_a_watched_wait_cancelled_from_elsewhere_stays_cancelled():
    entry = NodeEntry("d0", NodeKind.DECODE, "127.0.0.1:1", static=False)

    async def scenario():
        waiting = asyncio.ensure_future(unless_gone(asyncio.Event().wait(), [entry]))
        await asyncio.sleep(0)
        waiting.cancel()  # the client left: the wait ends cancelled, not with NodeGone
        entry.gone.set()
        try:
            await waiting
        except asyncio.CancelledError:
            return "cancelled"
        except NodeGone:
            return "gone"

    assert run(scenario()) == "cancelled"

"""The real router server, in-process, against fake colocated nodes (each runs both phases).

Asserts what a client relies on: a colocated node registers and Health counts it; its
tokens 1..n reach the client exactly; a refusing node is skipped and every node
refusing is RESOURCE_EXHAUSTED; no node of any usable kind is UNAVAILABLE naming what
is missing; a node lost mid-stream is resumed on another node with the tokens already
streamed, so the client sees no gap and no duplicate; a client cancel reaches the node.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from pdserve.proto import node_pb2, pdserve_pb2, pdserve_pb2_grpc
from pdserve.testing.fake_colocated import FakeColocated
from pdserve.testing.node_server import colocated_nodes
from pdserve.testing.router import generate, run
from pdserve.testing.router import running_router as router
from pdserve.engine.config import DEFAULT_BLOCK_SIZE
from pdserve.testing.waiting import until

LENGTH = pdserve_pb2.FINISH_REASON_LENGTH


@pytest.fixture(scope="module")
def output_ids(router_model) -> list[int]:
    ids = router_model[1].tokenizer.encode(" the quick brown fox jumps over")
    assert 0 not in ids and len(ids) >= 6  # 0 is the tiny model's eos
    return ids


async def health(address: str) -> pdserve_pb2.HealthResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pdserve_pb2_grpc.GenerationStub(channel).Health(pdserve_pb2.HealthRequest())


def request(max_tokens: int, n: int = 1) -> pdserve_pb2.GenerateRequest:
    params = pdserve_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n)
    return pdserve_pb2.GenerateRequest(text="hello world", request_id="req-c", sampling_params=params)


async def status_of(call: Callable[[], object]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call()
    return err.value


def test_colocated_nodes_register_and_health_counts_them(router_model):
    async def scenario():
        async with router(router_model) as address:
            before = await health(address)
            async with colocated_nodes(address, FakeColocated([]), FakeColocated([])):
                return before, await health(address)

    before, serving = run(scenario())
    assert (before.serving, before.colocated_nodes) == (False, 0)
    assert (serving.serving, serving.colocated_nodes, serving.prefill_nodes, serving.decode_nodes) == (True, 2, 0, 0)


def test_every_token_comes_from_the_colocated_node(router_model, output_ids):
    node = FakeColocated(output_ids)

    async def scenario():
        async with router(router_model) as address, colocated_nodes(address, node):
            return await generate(address, request(len(output_ids), n=2))

    responses = run(scenario())
    tokenizer = router_model[1].tokenizer
    for index in (0, 1):
        mine = [r for r in responses if r.index == index]
        assert [t for r in mine for t in r.token_ids] == output_ids
        assert "".join(r.text for r in mine) == tokenizer.decode(output_ids)
        assert [r.finish_reason for r in mine][-1] == LENGTH
        assert mine[-1].usage.completion_tokens == len(output_ids) and mine[-1].timings.kv_transfer_bytes == 0
    assert sorted(r.sample_index for r in node.requests) == [0, 1]
    first = node.requests[0]
    assert list(first.prompt_token_ids) == tokenizer.encode("hello world") and not first.resumed_token_ids
    assert first.sampling_params.n == 1 and first.sampling_params.max_tokens == len(output_ids)
    assert first.request_id.startswith("req-c-") and not node.cancelled


def test_a_refusing_node_is_skipped_and_all_refusing_is_resource_exhausted(router_model, output_ids):
    full = FakeColocated(output_ids, queued_tokens=0, refuse=True)  # ranked first: least queued
    free = FakeColocated(output_ids, queued_tokens=500)

    async def scenario():
        async with router(router_model) as address, colocated_nodes(address, full, free):
            served = await generate(address, request(len(output_ids)))
            free.refuse = True
            refused = await status_of(lambda: generate(address, request(len(output_ids))))
            return served, refused

    served, refused = run(scenario())
    assert [t for r in served for t in r.token_ids] == output_ids
    # Asked first (least queued), refused, then the next node served the same request.
    assert full.requests[0].request_id == free.requests[0].request_id
    assert len(free.requests) == 2  # the second request: skipped or refused again by `full`, refused here
    assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no colocated node can take the request" in refused.details()


def test_no_node_at_all_is_unavailable_naming_what_is_missing(router_model):
    async def scenario():
        async with router(router_model) as address:
            return await status_of(lambda: generate(address, request(4)))

    error = run(scenario())
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert error.details() == ("no prefill and no decode node is available, and no colocated node; "
                               "the cluster cannot serve")


def test_a_node_lost_mid_stream_is_resumed_on_another_without_gap_or_duplicate(router_model, output_ids):
    dying = FakeColocated(output_ids, queued_tokens=0, die_after=2)  # ranked first
    healthy = FakeColocated(output_ids, queued_tokens=500)

    async def scenario():
        async with router(router_model) as address, colocated_nodes(address, dying, healthy):
            return await generate(address, request(len(output_ids)))

    responses = run(scenario())
    assert [t for r in responses for t in r.token_ids] == output_ids
    assert "".join(r.text for r in responses) == router_model[1].tokenizer.decode(output_ids)
    assert responses[-1].usage.completion_tokens == len(output_ids)
    [lost], [resumed] = dying.requests, healthy.requests
    assert list(resumed.resumed_token_ids) == output_ids[:2]
    assert list(resumed.prompt_token_ids) == list(lost.prompt_token_ids)
    assert resumed.request_id == f"{lost.request_id}~1"


def test_a_resume_needs_a_node_left(router_model, output_ids):
    dying = FakeColocated(output_ids, die_after=2)

    async def scenario():
        async with (router(router_model) as address, colocated_nodes(address, dying),
                    grpc.aio.insecure_channel(address) as channel):
            call = pdserve_pb2_grpc.GenerationStub(channel).Generate(request(len(output_ids)))
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for response in call:
                    received.extend(response.token_ids)
            return received, err.value

    received, error = run(scenario())
    assert received == output_ids[:2]
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert error.details().startswith("no colocated node is available: colocated node 127.0.0.1:")
    assert "UNAVAILABLE: fake colocated: node went away" in error.details()


def test_a_client_cancel_cancels_the_node_call(router_model, output_ids):
    node = FakeColocated(output_ids, hang=True)

    async def scenario():
        async with router(router_model) as address, colocated_nodes(address, node):
            async with grpc.aio.insecure_channel(address) as channel:
                call = pdserve_pb2_grpc.GenerationStub(channel).Generate(request(len(output_ids) + 10))
                await call.read()
                call.cancel()
            await until(lambda: node.cancelled)

    run(scenario())
    assert node.cancelled == [node.requests[0].request_id]


def beam_node(output_ids: list[int], queued_tokens: int, dies: bool = False) -> FakeColocated:
    """Answers a beam search with one `beams` event, or dies first (UNAVAILABLE)."""
    beams = [node_pb2.BeamHypothesis(token_ids=output_ids[: 3 - i], finish_reason=LENGTH,
                                     cumulative_logprob=-1.0 - i, score=-0.5 - i) for i in range(2)]
    return FakeColocated(output_ids, queued_tokens=queued_tokens, die_after=0 if dies else None,
                         beam_results=node_pb2.BeamResults(beams=beams, num_prompt_tokens=2))


def beam_request() -> pdserve_pb2.GenerateRequest:
    params = pdserve_pb2.SamplingParams(max_tokens=3, temperature=0.0)
    return pdserve_pb2.GenerateRequest(text="hello world", request_id="req-b", sampling_params=params,
                                       beam_search=pdserve_pb2.BeamSearch(beam_width=2))


def test_a_beam_search_whose_node_is_lost_runs_again_on_another_node(router_model, output_ids):
    dying = beam_node(output_ids, queued_tokens=0, dies=True)  # ranked first
    healthy = beam_node(output_ids, queued_tokens=500)

    async def scenario():
        async with router(router_model) as address, colocated_nodes(address, dying, healthy):
            return await generate(address, beam_request())

    responses = run(scenario())
    assert [(r.index, list(r.token_ids), r.beam_score) for r in responses] == [
        (0, output_ids[:3], -0.5), (1, output_ids[:2], -1.5)]
    [lost], [again] = dying.requests, healthy.requests
    # Lost before its answer: the driver's rule for any sample, the next ranked node in the same attempt.
    assert again.request_id == lost.request_id and again.beam_search.beam_width == 2


def test_a_beam_search_fails_unavailable_once_every_node_is_lost(router_model, output_ids):
    nodes = [beam_node(output_ids, queued_tokens=i, dies=True) for i in range(2)]

    async def scenario():
        async with router(router_model) as address, colocated_nodes(address, *nodes):
            return await status_of(lambda: generate(address, beam_request()))

    error = run(scenario())
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    # The driver's message for any sample: every node, and why it was lost.
    assert error.details().startswith("no colocated node is available: colocated node 127.0.0.1:")
    assert error.details().count("UNAVAILABLE: fake colocated: node went away") == 2
    assert [len(n.requests) for n in nodes] == [1, 1]


def test_a_turn_carrying_its_answer_goes_to_the_node_that_generated_it(router_model):
    """Two conversations share a system prompt. The first was answered on c0; the second, sent
    while c0 was busy, on c1, where the shared prompt was last sent. The first conversation's next
    turn (the prompt, its answer, a new message) goes back to c0, which cached the answer as it
    generated it, though both nodes are idle again and the shared prompt was last seen on c1."""
    block = DEFAULT_BLOCK_SIZE
    shared = list(range(10, 10 + 2 * block))
    answer_0, answer_1 = list(range(100, 100 + 2 * block)), list(range(200, 200 + 2 * block))
    c0, c1 = FakeColocated(answer_0), FakeColocated(answer_1)

    def prompt(token_ids: list[int]) -> pdserve_pb2.GenerateRequest:
        params = pdserve_pb2.SamplingParams(max_tokens=2 * block, temperature=0.0)
        return pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=token_ids), sampling_params=params)

    async def scenario():
        async with router(router_model) as address, colocated_nodes(address, c0, c1) as nodes:
            await generate(address, prompt(shared))  # both idle: c0, the lower id
            c0.queued_tokens = 1 << 20  # far beyond the affinity's slack
            await nodes[0].report()
            await generate(address, prompt(shared))
            c0.queued_tokens = 0
            await nodes[0].report()
            await generate(address, prompt([*shared, *answer_0, 7, 8, 9]))

    run(scenario())
    assert [len(c0.requests), len(c1.requests)] == [2, 1]
    assert list(c0.requests[-1].prompt_token_ids) == [*shared, *answer_0, 7, 8, 9]

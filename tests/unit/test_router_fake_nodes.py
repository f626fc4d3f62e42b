"""The real router server, in-process, against fake prefill/decode nodes (pdserve.testing).

Asserts what a client relies on: the streamed token ids, text and finish reasons; that
token 1 comes from the prefill node; exact status codes for bad input, missing nodes
and a refusing decode node; and that a stop string, a client cancellation or a
deadline reaches the nodes as a cancellation. Everything runs on 127.0.0.1 in one
process; every server and channel is closed even when a test fails.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.proto import node_pb2, pdserve_pb2, pdserve_pb2_grpc
from pdserve.testing.fake_nodes import FAKE_LAYOUT_ID, Script
from pdserve.testing.node_server import fake_nodes, started
from pdserve.testing.router import generate, run
from pdserve.testing.serve_fakes import SENTENCE, at_once_nodes
from pdserve.testing.router import running_router as router
from pdserve.testing.waiting import until

LENGTH = pdserve_pb2.FINISH_REASON_LENGTH
STOP = pdserve_pb2.FINISH_REASON_STOP


@pytest.fixture(scope="module")
def output_ids(router_model) -> list[int]:
    ids = router_model[1].tokenizer.encode(" the quick brown fox jumps over")
    assert 0 not in ids and len(ids) >= 6  # 0 is the tiny model's eos
    return ids


def text_request(text: str = "hello world", **params) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(text=text, sampling_params=pdserve_pb2.SamplingParams(**params))


def scripted(ids: list[int], **kwargs) -> Script:
    """Token 1 from the prefill node, the rest from the decode node in events of 1-2 tokens."""
    rest = ids[1:]
    events = [node_pb2.DecodeTokens(token_ids=rest[i : i + 2]) for i in range(0, len(rest) - 1, 2)]
    if len(rest) % 2:
        events.append(node_pb2.DecodeTokens(token_ids=rest[-1:]))
    events[-1].finish_reason = LENGTH
    events[-1].stop_token_id = -1
    return Script(first_token=lambda index: ids[0], decode_events=lambda index: events, **kwargs)


def test_streams_token_one_from_prefill_then_decode_tokens(router_model, output_ids):
    async def scenario():
        async with router(router_model) as address, fake_nodes(address, scripted(output_ids)) as (calls, nodes):
            request = text_request(max_tokens=len(output_ids), temperature=0.0)
            request.request_id = "req-1"
            return calls, await generate(address, request), nodes[1].address

    calls, responses, decode_address = run(scenario())
    tokenizer = router_model[1].tokenizer
    assert responses[0].token_ids == [output_ids[0]]  # token 1: the prefill node's answer
    assert [t for r in responses for t in r.token_ids] == output_ids
    assert "".join(r.text for r in responses) == tokenizer.decode(output_ids)
    assert [r.finish_reason for r in responses] == [0] * (len(responses) - 1) + [LENGTH]
    assert {r.request_id for r in responses} == {"req-1"} and {r.index for r in responses} == {0}
    last = responses[-1]
    prompt = tokenizer.encode("hello world")
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), len(output_ids))
    assert last.usage.cached_prompt_tokens == 16 and last.stop_token_id == -1
    assert (last.timings.prefill_s, last.timings.kv_transfer_s, last.timings.kv_transfer_bytes) == (0.25, 0.125, 4096)
    assert 0 < last.timings.ttft_s <= last.timings.e2e_s
    [decode], [prefill] = calls.decode_requests, calls.prefill_requests
    assert list(decode.prompt_token_ids) == prompt == list(prefill.prompt_token_ids)
    assert decode.request_id == prefill.request_id and decode.request_id.startswith("req-1")
    assert decode.seed == prefill.seed and decode.sampling_params.seed == decode.seed  # one resolved seed
    assert decode.sampling_params.max_tokens == len(output_ids) and decode.sampling_params.n == 1
    # READY's layout, named: the prefill node fetches the layout itself from the decode node it names.
    assert prefill.decode_kv_layout_id == FAKE_LAYOUT_ID and list(prefill.decode_block_ids) == [7, 3, 5]
    assert prefill.decode_address == decode_address
    assert not calls.cancelled


def test_n_samples_share_the_seed_and_stream_by_index(router_model, output_ids):
    per_index = {0: output_ids[:3], 1: output_ids[3:6]}
    events = {i: [node_pb2.DecodeTokens(token_ids=ids[1:], finish_reason=LENGTH)] for i, ids in per_index.items()}
    script = Script(first_token=lambda i: per_index[i][0], decode_events=lambda i: events[i])

    async def scenario():
        async with router(router_model) as address, fake_nodes(address, script) as (calls, _):
            return calls, await generate(address, text_request(n=2, max_tokens=3, seed=1234))

    calls, responses = run(scenario())
    for index, ids in per_index.items():
        mine = [r for r in responses if r.index == index]
        assert [t for r in mine for t in r.token_ids] == ids
        assert mine[-1].finish_reason == LENGTH
    assert sorted(r.sample_index for r in calls.decode_requests) == [0, 1]
    assert sorted(r.sample_index for r in calls.prefill_requests) == [0, 1]
    assert {r.seed for r in calls.decode_requests + calls.prefill_requests} == {1234}
    assert len({r.request_id for r in calls.decode_requests}) == 2


def test_prompt_logprobs_come_once_with_sample_zeros_token_one(router_model, output_ids):
    per_index = {0: output_ids[:3], 1: output_ids[3:6]}
    events = {i: [node_pb2.DecodeTokens(token_ids=ids[1:], finish_reason=LENGTH)] for i, ids in per_index.items()}
    prompt = [pdserve_pb2.TokenLogprobs(token_id=t, logprob=-1.5, top=[pdserve_pb2.TopLogprob(token_id=9, logprob=-0.5)])
              for t in (11, 12)]
    script = Script(first_token=lambda i: per_index[i][0], decode_events=lambda i: events[i], prompt_logprobs=prompt)

    async def scenario():
        async with router(router_model) as address, fake_nodes(address, script) as (calls, _):
            return calls, await generate(address, text_request(n=2, max_tokens=3, seed=7, prompt_logprobs=1))

    calls, responses = run(scenario())
    with_prompt = [r for r in responses if r.prompt_logprobs]
    assert len(with_prompt) == 1 and with_prompt[0].index == 0 and list(with_prompt[0].token_ids) == [output_ids[0]]
    assert list(with_prompt[0].prompt_logprobs) == prompt
    # Only sample 0's prefill scores the prompt; no decode node is asked to.
    asked = {r.sample_index: r.sampling_params.HasField("prompt_logprobs") for r in calls.prefill_requests}
    assert asked == {0: True, 1: False}
    assert not any(r.sampling_params.HasField("prompt_logprobs") for r in calls.decode_requests if r.sample_index)


@pytest.mark.parametrize(
    "request_kwargs, field",
    [
        ({}, "prompt must be set"),
        ({"text": "hi", "sampling_params": {"top_p": 1.5}}, "top_p must be in (0, 1]"),
        ({"token_ids": [5, 5000]}, "token_ids contains 5000, outside the vocabulary [0, 960)"),
        ({"text": "hi", "sampling_params": {"max_tokens": 5000}}, "max_tokens must be <= "),
        ({"text": "hi", "sampling_params": {"prompt_logprobs": 21}}, "prompt_logprobs must be <= 20, got 21"),
        ({"text": "hi", "sampling_params": {"prompt_logprobs": -1}}, "prompt_logprobs must be >= 0, got -1"),
    ],
)
def test_bad_requests_are_invalid_argument_naming_the_field(router_model, output_ids, request_kwargs, field):
    kwargs = dict(request_kwargs)
    if "token_ids" in kwargs:
        kwargs["token_ids"] = pdserve_pb2.TokenIds(ids=kwargs["token_ids"])
    if "sampling_params" in kwargs:
        kwargs["sampling_params"] = pdserve_pb2.SamplingParams(**kwargs["sampling_params"])

    async def scenario():
        async with router(router_model) as address, fake_nodes(address, scripted(output_ids)) as (calls, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(address, pdserve_pb2.GenerateRequest(**kwargs))
            return calls, err.value

    calls, error = run(scenario())
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.details()
    assert not calls.decode_requests and not calls.prefill_requests


def test_no_nodes_is_unavailable_at_once(router_model):
    async def scenario():
        async with router(router_model) as address:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                # Had the router waited for a node, this deadline would end it DEADLINE_EXCEEDED.
                await generate(address, text_request(), timeout_s=5.0)
            return err.value

    error = run(scenario())
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert "no prefill and no decode node" in error.details()


def test_decode_refusal_is_resource_exhausted_without_prefill(router_model, output_ids):
    async def scenario():
        script = scripted(output_ids, refuse_decode=True)
        async with router(router_model) as address, fake_nodes(address, script) as (calls, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(address, text_request())
            return calls, err.value

    calls, error = run(scenario())
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(calls.decode_requests) == 1 and not calls.prefill_requests


def test_a_refusing_decode_node_is_skipped_for_the_next(router_model, output_ids):
    async def scenario():
        async with router(router_model) as address, fake_nodes(address, scripted(output_ids), decode=2) as (_, nodes):
            first, second = nodes[1].servicer, nodes[2].servicer
            first.refuse = True  # equal free blocks: "d0" is asked first, by id
            await nodes[1].stop_heartbeats()  # no fresh stats: its refusal stands for the next request
            one = await generate(address, text_request(max_tokens=len(output_ids)))
            two = await generate(address, text_request(max_tokens=len(output_ids)))
            return one, two, len(first.requests), len(second.requests)

    one, two, asked_first, asked_second = run(scenario())
    for responses in (one, two):
        assert [t for r in responses for t in r.token_ids] == output_ids
    assert (asked_first, asked_second) == (1, 2)  # the second request skipped the full node


def test_stop_string_ends_the_sample_and_cancels_the_decode_stream(router_model, output_ids):
    events = [node_pb2.DecodeTokens(token_ids=[t]) for t in output_ids[1:]]  # never finishes by itself
    script = Script(first_token=lambda i: output_ids[0], decode_events=lambda i: events, hang_after_events=True)

    async def scenario():
        async with router(router_model) as address, fake_nodes(address, script) as (calls, _):
            responses = await generate(address, text_request(max_tokens=50, stop=["brown"]))
            await calls.wait_cancelled("decode", calls.decode_requests[0].request_id)
            return responses

    responses = run(scenario())
    last = responses[-1]
    assert (last.finish_reason, last.stop_string, last.stop_token_id) == (STOP, "brown", -1)
    text = "".join(r.text for r in responses)
    assert text == " the quick "


def test_client_cancellation_reaches_both_nodes(router_model, output_ids):
    async def scenario():
        async with router(router_model) as address, fake_nodes(address, scripted(output_ids, hang_prefill=True)) as (calls, _):
            async with grpc.aio.insecure_channel(address) as channel:
                call = pdserve_pb2_grpc.GenerationStub(channel).Generate(text_request())
                await until(lambda: calls.prefill_requests, 30)
                call.cancel()
            req_id = calls.prefill_requests[0].request_id
            await calls.wait_cancelled("prefill", req_id)
            await calls.wait_cancelled("decode", req_id)

    run(scenario())


def test_deadline_cancels_both_node_calls(router_model, output_ids):
    async def scenario():
        async with router(router_model) as address, fake_nodes(address, scripted(output_ids, hang_prefill=True)) as (calls, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(address, text_request(), timeout_s=0.5)
            req_id = calls.prefill_requests[0].request_id
            await calls.wait_cancelled("prefill", req_id)
            await calls.wait_cancelled("decode", req_id)
            return err.value

    assert run(scenario()).code() is grpc.StatusCode.DEADLINE_EXCEEDED


def test_token_one_can_end_the_sample(router_model, output_ids):
    async def scenario():
        async with router(router_model) as address, fake_nodes(address, scripted(output_ids)) as (calls, _):
            responses = await generate(address, text_request(max_tokens=1))
            await calls.wait_cancelled("decode", calls.decode_requests[0].request_id)
            return responses

    [only] = run(scenario())
    assert list(only.token_ids) == output_ids[:1] and only.finish_reason == LENGTH
    assert only.usage.completion_tokens == 1


def test_stop_token_from_the_decode_node(router_model, output_ids):
    stop_token = output_ids[2]
    events = [node_pb2.DecodeTokens(token_ids=output_ids[1:3], finish_reason=STOP, stop_token_id=stop_token)]
    script = Script(first_token=lambda i: output_ids[0], decode_events=lambda i: events)

    async def scenario():
        async with router(router_model) as address, fake_nodes(address, script):
            return await generate(address, text_request(max_tokens=10, stop_token_ids=[stop_token]))

    responses = run(scenario())
    assert [t for r in responses for t in r.token_ids] == output_ids[:3]
    assert (responses[-1].finish_reason, responses[-1].stop_token_id) == (STOP, stop_token)


def resumable(ids: list[int], **kwargs) -> Script:
    """Like `scripted`, and a resumed attempt goes on from the resumed tokens."""

    def rest_after(resumed: list[int]) -> list[node_pb2.DecodeTokens]:
        rest = ids[len(resumed) + 1 :]
        if not rest:
            return [node_pb2.DecodeTokens(finish_reason=LENGTH, stop_token_id=-1)]
        return [node_pb2.DecodeTokens(token_ids=rest, finish_reason=LENGTH, stop_token_id=-1)]

    script = scripted(ids, **kwargs)
    script.resumed_first_token = lambda resumed: ids[len(resumed)]
    script.resumed_events = rest_after
    return script


async def collect(address: str, request: pdserve_pb2.GenerateRequest, received: list | None = None):
    """(responses, error or None): what a client received before the stream ended (appended
    to `received` as they come, when given)."""
    received = [] if received is None else received
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            async for response in pdserve_pb2_grpc.GenerationStub(channel).Generate(request):
                received.append(response)
        except grpc.aio.AioRpcError as exc:
            return received, exc
    return received, None


def test_a_decode_node_dying_mid_stream_resumes_on_another(router_model, output_ids):
    script = resumable(output_ids)
    script.decode_events = lambda index: [node_pb2.DecodeTokens(token_ids=[output_ids[1]])]

    async def scenario():
        async with router(router_model) as address, fake_nodes(address, script, decode=2) as (calls, nodes):
            # d0 (nodes[1]) is ranked first (a tie in free blocks goes by id) and dies mid-stream;
            # the resume goes to d1, which this router has reserved nothing on.
            nodes[1].servicer.fail_after_events = True
            received, error = await collect(address, text_request(max_tokens=len(output_ids)))
            return received, error, calls

    received, error, calls = run(scenario())
    assert error is None
    assert [t for r in received for t in r.token_ids] == output_ids  # no gap, no duplicate
    resumed = [r for r in calls.decode_requests if r.resumed_token_ids]
    assert [list(r.resumed_token_ids) for r in resumed] == [output_ids[:2]]
    assert resumed[0].request_id.endswith("~1")
    assert [list(r.resumed_token_ids) for r in calls.prefill_requests] == [[], output_ids[:2]]
    assert received[-1].usage.completion_tokens == len(output_ids)


def test_a_resume_does_not_score_the_prompt_again(router_model, output_ids):
    script = resumable(output_ids)
    script.decode_events = lambda index: [node_pb2.DecodeTokens(token_ids=[output_ids[1]])]
    script.prompt_logprobs = [pdserve_pb2.TokenLogprobs(token_id=5, logprob=-2.0)]

    async def scenario():
        async with router(router_model) as address, fake_nodes(address, script, decode=2) as (calls, nodes):
            nodes[1].servicer.fail_after_events = True
            received, error = await collect(address, text_request(max_tokens=len(output_ids), prompt_logprobs=0))
            return received, error, calls

    received, error, calls = run(scenario())
    assert error is None
    assert [t for r in received for t in r.token_ids] == output_ids
    assert [list(r.prompt_logprobs) for r in received if r.prompt_logprobs] == [script.prompt_logprobs]
    assert [r.sampling_params.HasField("prompt_logprobs") for r in calls.prefill_requests] == [True, False]


def dying_decode_script(output_ids):
    script = resumable(output_ids, fail_decode_after_events=True)
    script.decode_events = lambda index: [node_pb2.DecodeTokens(token_ids=[output_ids[1]])]
    script.resumed_events = lambda resumed: [node_pb2.DecodeTokens(token_ids=[output_ids[len(resumed) + 1]])]
    return script


def test_a_decode_node_that_keeps_dying_is_unavailable_after_the_resumes(router_model, output_ids):
    async def scenario():
        async with router(router_model, max_node_failures_per_request=5) as address, \
                fake_nodes(address, dying_decode_script(output_ids)):
            return await collect(address, text_request(max_tokens=len(output_ids)))

    received, error = run(scenario())
    assert error.code() is grpc.StatusCode.UNAVAILABLE and "engine core died" in error.details()
    assert "no resume left" in error.details()
    # Two resumes (max_resumes), each adding the prefill's token and one decoded token.
    assert [t for r in received for t in r.token_ids] == output_ids[:6]


def test_a_request_that_fails_its_nodes_ends_internal_after_max_node_failures(router_model, output_ids):
    # The default (3) comes before the resume budget runs out: the request may be what kills them.
    async def scenario():
        async with router(router_model) as address, fake_nodes(address, dying_decode_script(output_ids)) as (calls, _):
            received, error = await collect(address, text_request(max_tokens=len(output_ids)))
            return received, error, calls

    received, error, calls = run(scenario())
    assert error.code() is grpc.StatusCode.INTERNAL
    assert error.details().startswith("3 of this request's node attempts failed, the last: decode node ")
    assert error.details().endswith("engine core died; not sent to another node (--max-node-failures-per-request 3): "
                                    "the request itself may be what fails them")
    assert len(calls.decode_requests) == 3
    assert [t for r in received for t in r.token_ids] == output_ids[:6]


def test_one_node_failure_allowed_ends_the_request_at_the_first(router_model, output_ids):
    async def scenario():
        async with router(router_model, max_node_failures_per_request=1) as address, \
                fake_nodes(address, dying_decode_script(output_ids)) as (calls, _):
            received, error = await collect(address, text_request(max_tokens=len(output_ids)))
            return received, error, calls

    received, error, calls = run(scenario())
    assert error.code() is grpc.StatusCode.INTERNAL and error.details().startswith("1 of this request's node attempts failed")
    assert len(calls.decode_requests) == 1
    assert [t for r in received for t in r.token_ids] == output_ids[:2]


def test_a_full_prefill_queue_sends_the_same_reservation_to_the_next(router_model, output_ids):
    script = resumable(output_ids)

    async def scenario():
        async with router(router_model) as address, fake_nodes(address, script, prefill=2) as (calls, nodes):
            nodes[0].servicer.refuse = True
            nodes[1].servicer.refuse = False
            first, _ = await collect(address, text_request(max_tokens=len(output_ids)))
            nodes[0].servicer.refuse, nodes[1].servicer.refuse = False, True
            second, _ = await collect(address, text_request(max_tokens=len(output_ids)))
            return first, second, calls

    first, second, calls = run(scenario())
    for received in (first, second):
        assert [t for r in received for t in r.token_ids] == output_ids
    assert len(calls.decode_requests) == 2  # one reservation per request, reused by the second prefill
    assert len(calls.prefill_requests) in (2, 3, 4)
    assert {r.request_id for r in calls.prefill_requests} == {r.request_id for r in calls.decode_requests}


def test_a_dying_prefill_node_is_retried_on_another_with_a_fresh_reservation(router_model, output_ids):
    script = resumable(output_ids)

    async def scenario():
        async with router(router_model) as address, fake_nodes(address, script, prefill=2) as (calls, nodes):
            nodes[0].servicer.fail = True
            await nodes[0].stop()  # it does not answer the probe either: suspect
            received, error = await collect(address, text_request(max_tokens=len(output_ids)))
            again, _ = await collect(address, text_request(max_tokens=len(output_ids)))
            return received, error, again, calls

    received, error, again, calls = run(scenario())
    assert error is None
    for got in (received, again):
        assert [t for r in got for t in r.token_ids] == output_ids
    # The first request may have tried the dead node (a fresh attempt id), the second never does.
    assert len(calls.decode_requests) in (2, 3)


def test_no_decode_node_left_is_unavailable_naming_it(router_model, output_ids):
    script = resumable(output_ids, hang_after_events=True)
    script.decode_events = lambda index: [node_pb2.DecodeTokens(token_ids=[output_ids[1]])]

    async def scenario():
        async with router(router_model) as address, fake_nodes(address, script) as (calls, nodes):
            so_far: list = []
            client = asyncio.create_task(collect(address, text_request(max_tokens=len(output_ids)), so_far))
            await until(lambda: sum(len(r.token_ids) for r in so_far) >= 2, 30)  # the decoded token is streamed
            await nodes[1].stop()  # then the node dies
            return await client

    received, error = run(scenario())
    assert [t for r in received for t in r.token_ids] == output_ids[:2]
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert error.details().startswith("no decode node is available: ") and "was lost" in error.details()


@pytest.mark.parametrize("stream_interval", [1, 4])
def test_the_nodes_that_answer_at_once_stream_the_sentence_for_max_tokens(router_model, stream_interval):
    """What the router benchmark runs behind (python -m pdserve.testing.serve_fakes): token 1 from the
    prefill, then the sentence's ids cycling until max_tokens, as a node front streams them at the
    router's --stream-interval (the decode's first token alone, then `stream_interval` per event,
    one response each); every landed KV push is forgotten."""
    ids = router_model[1].tokenizer.encode(SENTENCE, add_special_tokens=False)
    max_tokens = len(ids) + 3  # once round the sentence and on

    async def scenario():
        async with router(router_model, stream_interval=stream_interval) as address:
            calls, nodes = at_once_nodes(address, router_model[1])
            async with started(nodes):
                responses = await generate(address, text_request(max_tokens=max_tokens, ignore_eos=True))
            return responses, calls

    responses, calls = run(scenario())
    assert responses[0].token_ids == ids[:1]
    assert [t for r in responses for t in r.token_ids] == (ids + ids)[:max_tokens]
    assert [len(r.token_ids) for r in responses[1:3]] == [1, stream_interval]
    assert len(responses) == 2 + -(-(max_tokens - 2) // stream_interval)
    assert responses[-1].finish_reason == LENGTH
    assert {r.stream_interval for r in calls.decode_requests} == {stream_interval}
    assert len(calls.decode_requests) == 1 and not calls.kv_done

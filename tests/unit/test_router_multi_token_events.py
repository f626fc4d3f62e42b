"""A node event that carries several tokens (a node front that fell behind joins what waited:
pdserve/node/front/inbox.py) reaches the client exactly as the same tokens one per event: the same token
ids, text, logprobs in order, finish reason and usage, over gRPC and over HTTP, streamed and not;
one response per event; a stop string inside an event ends the sample where it would one token
per event; a resume counts the tokens of every event the client got. The real router in-process,
fake prefill and decode nodes (pdserve.testing)."""

from __future__ import annotations

import json

import aiohttp
import pytest

from pdserve.proto import node_pb2, pdserve_pb2
from pdserve.router.config import RouterConfig
from pdserve.testing.fake_nodes import Script
from pdserve.testing.node_server import fake_nodes
from pdserve.testing.router import generate, run, running_router_server

LENGTH = pdserve_pb2.FINISH_REASON_LENGTH
STOP = pdserve_pb2.FINISH_REASON_STOP
SAMPLES = {0: " the quick brown fox jumps over", 1: " a lazy dog sleeps in the sun"}


@pytest.fixture(scope="module")
def sample_ids(router_model) -> dict[int, list[int]]:
    ids = {i: router_model[1].tokenizer.encode(text, add_special_tokens=False) for i, text in SAMPLES.items()}
    assert all(0 not in s and len(s) >= 6 for s in ids.values())  # 0 is the tiny model's eos
    return ids


def scored(token: int, position: int) -> pdserve_pb2.TokenLogprobs:
    """A made-up score that names its token and its place in the sample."""
    logprob = -0.125 * (position + 1)
    return pdserve_pb2.TokenLogprobs(token_id=token, logprob=logprob,
                                     top=[pdserve_pb2.TopLogprob(token_id=token, logprob=logprob)])


def events_of(ids: list[int], per_event: int, finishes: bool = True) -> list[node_pb2.DecodeTokens]:
    """Tokens 2.. of a sample, `per_event` per decode event, each with its score."""
    rest = ids[1:]
    events = [node_pb2.DecodeTokens(token_ids=rest[i : i + per_event], stop_token_id=-1,
                                    logprobs=[scored(t, i + j + 1) for j, t in enumerate(rest[i : i + per_event])])
              for i in range(0, len(rest), per_event)]
    if finishes:
        events[-1].finish_reason = LENGTH
    return events


def script_for(sample_ids: dict[int, list[int]], per_event: int, **kwargs) -> Script:
    script = Script(first_token=lambda i: sample_ids[i][0],
                    decode_events=lambda i: events_of(sample_ids[i], per_event), **kwargs)
    script.prefill_logprobs = scored(sample_ids[0][0], 0)
    return script


def request(n: int = 1, **params) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(text="hello world", sampling_params=pdserve_pb2.SamplingParams(n=n, **params))


@pytest.mark.parametrize("per_event", [1, 3])
def test_grpc_relays_each_event_as_one_response_with_every_token_and_score(router_model, sample_ids, per_event):
    async def scenario():
        async with running_router_server(router_model) as server, \
                fake_nodes(f"127.0.0.1:{server.port}", script_for(sample_ids, per_event)):
            return await generate(f"127.0.0.1:{server.port}",
                                  request(n=2, max_tokens=len(sample_ids[0]), seed=5, logprobs=1))

    responses = run(scenario())
    tokenizer = router_model[1].tokenizer
    for index, ids in sample_ids.items():
        mine = [r for r in responses if r.index == index]
        assert [t for r in mine for t in r.token_ids] == ids
        assert "".join(r.text for r in mine) == tokenizer.decode(ids)
        scores = [lp for r in mine for lp in r.logprobs]
        assert len(scores) == len(ids) and [lp.token_id for lp in scores[1:]] == ids[1:]  # token 1: the prefill's
        assert [lp.logprob for lp in scores][1:] == [-0.125 * (p + 1) for p in range(1, len(ids))]
        assert [r.finish_reason for r in mine] == [0] * (len(mine) - 1) + [LENGTH]
        assert mine[-1].usage.completion_tokens == len(ids)
        # Token 1 from the prefill, then one response per decode event.
        assert len(mine) == 1 + len(events_of(ids, per_event))


@pytest.mark.parametrize("per_event", [1, 3])
def test_a_stop_string_inside_an_event_ends_the_sample_there(router_model, sample_ids, per_event):
    ids = sample_ids[0]
    script = Script(first_token=lambda i: ids[0], decode_events=lambda i: events_of(ids, per_event, finishes=False),
                    hang_after_events=True)

    async def scenario():
        async with running_router_server(router_model) as server, \
                fake_nodes(f"127.0.0.1:{server.port}", script) as (calls, _):
            responses = await generate(f"127.0.0.1:{server.port}", request(max_tokens=50, stop=["brown"], logprobs=0))
            await calls.wait_cancelled("decode", calls.decode_requests[0].request_id)
            return responses

    responses = run(scenario())
    last = responses[-1]
    assert (last.finish_reason, last.stop_string, last.stop_token_id) == (STOP, "brown", -1)
    assert "".join(r.text for r in responses) == " the quick "
    # Through the token that completed the stop string (inside an event when per_event is 3), none after it.
    tokenizer = router_model[1].tokenizer
    until = next(k for k in range(1, len(ids) + 1) if "brown" in tokenizer.decode(ids[:k]))
    assert until % 3 != 1  # not the last of an event: the event goes on past it
    streamed = [t for r in responses for t in r.token_ids]
    assert streamed == ids[:until]
    assert [lp.token_id for r in responses for lp in r.logprobs] == streamed[1:]  # token 1: no score here
    assert last.usage.completion_tokens == until


def test_a_resume_after_a_multi_token_event_goes_on_after_its_last_token(router_model, sample_ids):
    ids = sample_ids[0]
    script = script_for(sample_ids, 3)
    script.decode_events = lambda index: events_of(ids, 3, finishes=False)[:1]  # tokens 2-4, then the node dies
    script.resumed_first_token = lambda resumed: ids[len(resumed)]
    script.resumed_events = lambda resumed: events_of(ids[len(resumed):], 2)

    async def scenario():
        async with running_router_server(router_model) as server, \
                fake_nodes(f"127.0.0.1:{server.port}", script, decode=2) as (calls, nodes):
            nodes[1].servicer.fail_after_events = True  # d0, ranked first, dies after its event
            responses = await generate(f"127.0.0.1:{server.port}", request(max_tokens=len(ids)))
            return responses, calls

    responses, calls = run(scenario())
    assert [t for r in responses for t in r.token_ids] == ids  # no gap, no duplicate
    assert [list(r.resumed_token_ids) for r in calls.decode_requests if r.resumed_token_ids] == [ids[:4]]
    assert responses[-1].usage.completion_tokens == len(ids)


async def http_completion(url: str, stream: bool, max_tokens: int) -> tuple[str, list[str], list[float], list]:
    """(text, logprob tokens, token logprobs, finish reasons of the chunks or the choice)."""
    body = {"prompt": "hello world", "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1, "stream": stream}
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200
        if not stream:
            [choice] = (await response.json())["choices"]
            return (choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"],
                    [choice["finish_reason"]])
        chunks = [json.loads(line[6:]) async for line in response.content if line.startswith(b"data: {")]
    choices = [c["choices"][0] for c in chunks]
    return ("".join(c["text"] for c in choices), [t for c in choices for t in c["logprobs"]["tokens"]],
            [lp for c in choices for lp in c["logprobs"]["token_logprobs"]], [c["finish_reason"] for c in choices])


@pytest.mark.parametrize("stream", [True, False])
def test_http_relays_multi_token_events_exactly_streamed_and_not(router_model, sample_ids, stream):
    ids = sample_ids[0]

    async def answer(per_event: int):
        async with running_router_server(router_model, http_port=0) as server, \
                fake_nodes(f"127.0.0.1:{server.port}", script_for(sample_ids, per_event)):
            return await http_completion(f"http://127.0.0.1:{server.http_port}", stream, len(ids))

    one, joined = run(answer(1)), run(answer(3))
    tokenizer = router_model[1].tokenizer
    text, tokens, token_logprobs, finishes = joined
    assert text == tokenizer.decode(ids)
    assert tokens == [tokenizer.decode([t]) for t in ids]
    assert token_logprobs[1:] == [-0.125 * (p + 1) for p in range(1, len(ids))]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    if stream:  # token 1's chunk, then one chunk per event
        assert (len(one[3]), len(finishes)) == (len(ids), 1 + len(events_of(ids, 3)))
    assert (one[0], one[1], one[2]) == (text, tokens, token_logprobs)


def test_a_stream_interval_below_one_is_refused_naming_the_flag(capsys):
    from pdserve.bench import http_front

    with pytest.raises(SystemExit) as exit_:
        http_front.main(["--stream-interval", "1", "0"])
    assert exit_.value.code == 2
    assert "--stream-interval" in capsys.readouterr().err
    with pytest.raises(ValueError, match="stream_interval must be >= 1, got 0"):
        RouterConfig(model="m", stream_interval=0)

"""Beam search served end to end, in float32, on a real `pdserve cluster --colocated 1` (router + one
node) and on a real 1P1D one (router + a prefill node + a decode node: the prefill node computes the
prompt with the search's top logprobs, the decode node runs the search, pdserve/router/dispatch/routes.py's disaggregated route).

Over gRPC (`GenerateRequest.beam_search`) and HTTP (the openai client with vLLM's
`use_beam_search`), the beams equal transformers `generate(num_beams=k, num_return_sequences=k,
do_sample=False, early_stopping=False, length_penalty)`, best first, scores included, while an
ordinary greedy stream runs beside them, token-exact. A client that cancels mid-search frees
every beam's blocks. Every node ends each test with no block used or reserved, nothing running
or waiting. (A cluster with neither a colocated node nor a pair: tests/unit/test_router_beam.py.)
"""

from __future__ import annotations

import asyncio
import time

import grpc
import openai
import pytest
from transformers import AutoTokenizer

from pdserve.engine.beam_search import BeamSearchParams
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from tests.e2e.cluster import NodeSettings
from tests.e2e.pair_clusters import cluster, model_dir, no_blocks_left  # noqa: F401  (fixtures)
from tests.integration.reference import greedy_references, transformers_beams

PROMPTS = [[5, 17, 99, 3, 44, 8, 21, 7, 60, 13, 2], list(range(1, 20))]


def beam_request(prompt: list[int], params: BeamSearchParams) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=prompt),
        sampling_params=pdserve_pb2.SamplingParams(max_tokens=params.max_tokens, ignore_eos=params.ignore_eos),
        beam_search=pdserve_pb2.BeamSearch(beam_width=params.beam_width, length_penalty=params.length_penalty))


def greedy_request(prompt: list[int], max_tokens: int) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=prompt),
        sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


@pytest.mark.parametrize("beam_width,length_penalty,max_tokens", [(3, 1.0, 10), (4, 0.5, 8), (2, 2.0, 9)])
def test_grpc_beams_equal_transformers_beside_a_greedy_stream(cluster, model_dir, beam_width, length_penalty,
                                                              max_tokens):
    params = BeamSearchParams(beam_width, max_tokens, length_penalty, ignore_eos=True)
    greedy_prompt = [7, 300, 12, 45, 9]

    async def run():
        async with grpc.aio.insecure_channel(cluster.router) as channel:
            stub = pdserve_pb2_grpc.GenerationStub(channel)

            async def collect(request):
                return [r async for r in stub.Generate(request, timeout=120)]

            return await asyncio.gather(collect(greedy_request(greedy_prompt, 12)),
                                        *(collect(beam_request(p, params)) for p in PROMPTS))

    greedy, *searches = asyncio.run(run())
    assert [t for r in greedy for t in r.token_ids] == greedy_references(model_dir, [greedy_prompt], [12])[0].token_ids
    for prompt, responses in zip(PROMPTS, searches):
        expected, scores = transformers_beams(model_dir, prompt, params, None)
        assert [r.index for r in responses] == list(range(beam_width))
        assert [list(r.token_ids) for r in responses] == expected
        assert [r.beam_score for r in responses] == pytest.approx(scores, rel=1e-5, abs=1e-5)
        for r in responses:
            assert r.finish_reason == pdserve_pb2.FINISH_REASON_LENGTH
            assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), max_tokens)
            assert r.beam_score == pytest.approx(r.cumulative_logprob / max_tokens ** length_penalty, rel=1e-5)


def test_http_use_beam_search_choices_are_the_beams_best_first(cluster, model_dir):
    client = openai.OpenAI(base_url=cluster.state.http, api_key="unused", max_retries=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    params = BeamSearchParams(beam_width=4, max_tokens=8, length_penalty=0.5, ignore_eos=True)
    expected, _ = transformers_beams(model_dir, PROMPTS[0], params, None)
    out = client.completions.create(model=cluster_model_name(client), prompt=PROMPTS[0], max_tokens=8, n=2,
                                    extra_body={"use_beam_search": True, "best_of": 4, "length_penalty": 0.5,
                                                "ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [tokenizer.decode(ids) for ids in expected[:2]]
    assert out.usage.completion_tokens == 2 * 8 and out.usage.prompt_tokens == len(PROMPTS[0])
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=cluster_model_name(client), prompt=PROMPTS[0], max_tokens=8, stream=True,
                                  extra_body={"use_beam_search": True, "best_of": 2})
    assert err.value.body["param"] == "stream"


def cluster_model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


async def collect(call) -> list[pdserve_pb2.GenerateResponse]:
    return [r async for r in call]


def test_a_client_cancelling_mid_search_frees_every_beam(cluster):
    params = BeamSearchParams(beam_width=4, max_tokens=400, ignore_eos=True)

    async def cancel_mid_search() -> int:
        async with grpc.aio.insecure_channel(cluster.router) as channel:
            stub = pdserve_pb2_grpc.GenerationStub(channel)
            search = asyncio.ensure_future(collect(stub.Generate(beam_request(PROMPTS[1], params), timeout=120)))
            deadline = time.monotonic() + 60
            used = 0
            while used <= prompt_blocks and time.monotonic() < deadline and not search.done():
                await asyncio.sleep(0.2)
                used = sum(s.used_blocks for s in cluster.stats())  # the beams hold blocks: the search is under way
            search.cancel()  # the client leaves: the router cancels its node call
            with pytest.raises(asyncio.CancelledError):
                await search
            return used

    prompt_blocks = -(-len(PROMPTS[1]) // NodeSettings().block_size)
    assert asyncio.run(cancel_mid_search()) > prompt_blocks  # more than the prompt's: the beams have forked
    # The autouse fixture checks that every block is free again, and nothing runs or waits.

"""Fuzzing the public API: over a thousand random and malformed GenerateRequests at a real 1P1D cluster.

The cases come from a seeded hypothesis strategy (derandomized, so every run sends the
same ones): missing, empty, odd-unicode, over-long and oversized prompts, token ids in
and out of the vocabulary, sampling values including NaN, inf, negative and huge ones,
random stop lists, random n and request ids. Each case's expected status is what the
router's own validator says against the cluster's known pools (OK or INVALID_ARGUMENT),
or RESOURCE_EXHAUSTED for a message over gRPC's 4 MiB limit; the test checks every
answer against it, that every INVALID_ARGUMENT message starts with a field's name, that
an accepted request streams all its samples to a finish reason, and afterwards that the
cluster still answers a greedy request with transformers' exact tokens and holds no
block on any node.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.e2e.cluster import NodeSettings, running_cluster
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.errors import InvalidRequest
from pdserve.router.model import load_router_model
from pdserve.router.requests.validation import KVCapacity, RequestValidator

from ..integration.reference import assert_matches, greedy_references

NUM_CASES = 1100
BLOCK_SIZE = 8
# 2560 tokens per pool: prompts between that and the model's 4096 fit the model but no node.
NUM_BLOCKS = 320
# Accepted requests in flight at once: their prompts always fit the decode pool together
# (3 x 3 samples x <= 20 blocks), so no request meets a full node (RESOURCE_EXHAUSTED).
ACCEPTED_CONCURRENCY = 3
REFUSED_CONCURRENCY = 64
CALL_TIMEOUT_S = 60.0
OVERSIZED = 5 << 20  # past gRPC's 4 MiB receive limit
FIELDS = {
    "prompt", "text", "token_ids", "request_id", "n", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "max_tokens", "min_tokens", "stop",
    "stop_token_ids", "ignore_eos", "logprobs",
}
INT32 = st.integers(-(2**31), 2**31 - 1)
PRINTABLE_ASCII = st.characters(min_codepoint=0x20, max_codepoint=0x7E)


def _repeated(element: st.SearchStrategy, low: int, high: int) -> st.SearchStrategy:
    """A long run of one drawn element: long inputs without drawing every item."""
    return st.builds(lambda item, count: item * count, element, st.integers(low, high))


@dataclasses.dataclass(frozen=True)
class Case:
    request: pdserve_pb2.GenerateRequest
    expected: grpc.StatusCode


# -- the strategy ----------------------------------------------------------------------
def _wild_float() -> st.SearchStrategy[float]:
    return st.one_of(st.floats(width=32), st.sampled_from([0.0, 1.0, -0.0, 1e-45, 3e38, float("nan"), float("inf")]))


def _tame_params() -> st.SearchStrategy[dict]:
    """Mostly acceptable values, so a good share of the cases really runs."""
    return st.fixed_dictionaries({}, optional={
        "n": st.integers(1, 3),
        "temperature": st.sampled_from([0.0, 0.5, 1.0, 1.7]),
        "top_p": st.floats(0.05, 1.0),
        "top_k": st.integers(1, 50),
        "min_p": st.floats(0.0, 0.5),
        "repetition_penalty": st.floats(0.5, 2.0),
        "presence_penalty": st.floats(-2.0, 2.0),
        "frequency_penalty": st.floats(-2.0, 2.0),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "max_tokens": st.integers(1, 4),
        "min_tokens": st.integers(0, 1),
        "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
        "stop_token_ids": st.lists(st.integers(0, 959), max_size=3),
        "ignore_eos": st.booleans(),
        "logprobs": st.integers(0, 20),
    })


def _wild_params() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({}, optional={
        "n": st.one_of(st.integers(0, 3), st.sampled_from([65, 2**32 - 1])),
        "temperature": _wild_float(),
        "top_p": _wild_float(),
        "top_k": st.one_of(st.integers(-2, 3), INT32),
        "min_p": _wild_float(),
        "repetition_penalty": _wild_float(),
        "presence_penalty": _wild_float(),
        "frequency_penalty": _wild_float(),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "max_tokens": st.one_of(st.integers(-2, 4), st.sampled_from([5000, 2**31 - 1, -(2**31)])),
        "min_tokens": st.one_of(st.integers(-1, 3), INT32),
        "stop": st.one_of(st.lists(st.one_of(st.text(max_size=8), _repeated(st.characters(), 250, 300)),
                                   max_size=4), _repeated(st.just(["s"]), 15, 20)),
        "stop_token_ids": st.one_of(st.lists(st.one_of(st.integers(0, 1000), INT32), max_size=4),
                                    _repeated(st.just([7]), 250, 300)),
        "ignore_eos": st.booleans(),
        "logprobs": st.one_of(st.integers(-1, 21), INT32),
    })


def _long_text() -> st.SearchStrategy[str]:
    # Over the character limit; over the model in tokens; between the pools and the model.
    return st.sampled_from(["x" * 262_145, "a b " * 3000, "hello " * 2700])


def _prompt() -> st.SearchStrategy[dict]:
    texts = st.builds(lambda t: {"text": t}, st.text(max_size=40))
    ids = st.builds(lambda ids: {"token_ids": ids}, st.lists(st.integers(0, 959), max_size=40))
    return st.one_of(
        st.just({}),
        texts, texts,
        st.builds(lambda t: {"text": t}, _long_text()),
        ids, ids, ids,
        st.builds(lambda ids: {"token_ids": ids}, st.lists(INT32, min_size=1, max_size=40)),
        st.builds(lambda n: {"token_ids": [5] * n}, st.sampled_from([2600, 4095, 4096, 9000])),
    )


def _request_id() -> st.SearchStrategy[str]:
    return st.one_of(st.just(""), st.just(""), st.text(PRINTABLE_ASCII, max_size=20), st.text(max_size=6),
                     _repeated(PRINTABLE_ASCII, 257, 300))


@st.composite
def generate_requests(draw) -> pdserve_pb2.GenerateRequest:
    prompt = draw(_prompt())
    request = pdserve_pb2.GenerateRequest(request_id=draw(_request_id()))
    if "text" in prompt:
        request.text = prompt["text"]
    elif "token_ids" in prompt:
        request.token_ids.ids.extend(prompt["token_ids"])
    params = draw(st.one_of(st.none(), _tame_params(), _tame_params(), _wild_params()))
    if params is not None:
        request.sampling_params.CopyFrom(pdserve_pb2.SamplingParams(**params))
    return request


def draw_requests(count: int) -> list[pdserve_pb2.GenerateRequest]:
    """`count` draws, duplicates dropped (hypothesis revisits simple examples now and then)."""
    drawn: dict[bytes, pdserve_pb2.GenerateRequest] = {}

    # Generation only (no shrinking, no example database): the same cases on every run.
    # One request per example: lists of them repeat far more.
    @settings(max_examples=count, derandomize=True, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(generate_requests())
    def collect(request):
        drawn.setdefault(request.SerializeToString(deterministic=True), request)

    collect()
    return list(drawn.values())


def oversized_requests() -> list[pdserve_pb2.GenerateRequest]:
    return [
        pdserve_pb2.GenerateRequest(text="x" * OVERSIZED),
        pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=[2**31 - 1] * (OVERSIZED // 5 + 1))),
        pdserve_pb2.GenerateRequest(text="hi", sampling_params=pdserve_pb2.SamplingParams(stop=["s" * OVERSIZED])),
    ]


def expected_status(validator: RequestValidator, request: pdserve_pb2.GenerateRequest) -> grpc.StatusCode:
    try:
        validator.validate(request)
    except InvalidRequest:
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.OK


# -- sending ---------------------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: list[pdserve_pb2.GenerateResponse]


async def _send(stub, request, gate: asyncio.Semaphore) -> Outcome:
    async with gate:
        responses: list[pdserve_pb2.GenerateResponse] = []
        try:
            async for response in stub.Generate(request, timeout=CALL_TIMEOUT_S):
                responses.append(response)
        except grpc.aio.AioRpcError as exc:
            return Outcome(exc.code(), exc.details() or "", responses)
        return Outcome(grpc.StatusCode.OK, "", responses)


async def send_all(router: str, cases: list[Case]) -> list[Outcome]:
    accepted = asyncio.Semaphore(ACCEPTED_CONCURRENCY)
    refused = asyncio.Semaphore(REFUSED_CONCURRENCY)
    async with grpc.aio.insecure_channel(router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        return await asyncio.gather(*(
            _send(stub, case.request, accepted if case.expected == grpc.StatusCode.OK else refused)
            for case in cases
        ))


async def tokenize_codes(router: str) -> list[tuple[grpc.StatusCode, str]]:
    """Tokenize takes the same character limit as a text prompt, and the same message limit."""
    codes = []
    async with grpc.aio.insecure_channel(router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        for text in ("hello", "x" * 262_145, "x" * OVERSIZED):
            try:
                await stub.Tokenize(pdserve_pb2.TokenizeRequest(text=text), timeout=CALL_TIMEOUT_S)
                codes.append((grpc.StatusCode.OK, ""))
            except grpc.aio.AioRpcError as exc:
                codes.append((exc.code(), exc.details()))
    return codes


def check(case: Case, outcome: Outcome) -> None:
    shown = str(case.request)[:400]
    assert outcome.code == case.expected, \
        f"{outcome.code.name} {outcome.details!r}, expected {case.expected.name}: {shown}"
    if outcome.code == grpc.StatusCode.INVALID_ARGUMENT:
        assert outcome.details.split(" ", 1)[0] in FIELDS, f"no field named: {outcome.details!r}"
    if outcome.code == grpc.StatusCode.OK:
        n = case.request.sampling_params.n if case.request.sampling_params.HasField("n") else 1
        finished = {r.index for r in outcome.responses if r.finish_reason != pdserve_pb2.FINISH_REASON_UNSPECIFIED}
        assert finished == set(range(n)), f"samples finished: {sorted(finished)} of n={n}: {shown}"


# -- the test --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


def test_random_and_malformed_requests_get_exact_statuses_and_leave_the_cluster_healthy(model_dir):
    model = load_router_model(model_dir)
    # The router's own rules against the pools the cluster will report.
    validator = RequestValidator(model, max_n=64, capacity=lambda: KVCapacity(BLOCK_SIZE, NUM_BLOCKS, NUM_BLOCKS))
    requests = draw_requests(NUM_CASES)
    cases = [Case(r, expected_status(validator, r)) for r in requests]
    cases += [Case(r, grpc.StatusCode.RESOURCE_EXHAUSTED) for r in oversized_requests()]
    expected = Counter(case.expected.name for case in cases)
    print(f"\nfuzz: {len(cases)} cases, expected {dict(expected)}")
    assert len(cases) >= 1000 and expected["OK"] >= 100 and expected["INVALID_ARGUMENT"] >= 500

    prompt = [3, 17, 99, 250, 7, 7, 512, 40, 41, 42, 900, 1]
    (reference,) = greedy_references(model_dir, [prompt], [8])
    settings_ = NodeSettings(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    with running_cluster(model_dir, 1, 1, settings_) as cluster:
        outcomes = asyncio.run(send_all(cluster.router, cases))
        seen = Counter(o.code.name for o in outcomes)
        fields = Counter(o.details.split(" ", 1)[0] for o in outcomes if o.code == grpc.StatusCode.INVALID_ARGUMENT)
        print(f"fuzz: answered {dict(seen)}; INVALID_ARGUMENT by field {dict(fields)}")
        for case, outcome in zip(cases, outcomes):
            check(case, outcome)

        greedy = pdserve_pb2.GenerateRequest(
            token_ids=pdserve_pb2.TokenIds(ids=prompt),
            sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        (after,) = asyncio.run(send_all(cluster.router, [Case(greedy, grpc.StatusCode.OK)]))
        assert after.code == grpc.StatusCode.OK, after.details
        assert_matches([[t for r in after.responses for t in r.token_ids]], [reference])

        tokenized = asyncio.run(tokenize_codes(cluster.router))
        assert [code for code, _ in tokenized] == [grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                                                   grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert tokenized[1][1] == "text must be at most 262144 characters, got 262145"

        stats = cluster.wait_all_blocks_free(timeout_s=10)
        assert [(s.kind, s.used_blocks, s.reserved_blocks) for s in stats] == [("prefill", 0, 0), ("decode", 0, 0)]

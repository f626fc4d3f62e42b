"""Which chunk positions score prompt tokens, across chunks and a preemption, and vLLM's shape."""

from __future__ import annotations

from pdserve.engine.prompt_logprobs import Logprob, PromptLogprobs, as_vllm, positions_to_score
from pdserve.engine.request import Request
from pdserve.engine.sampler import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams

PROMPT = list(range(100, 110))  # 10 tokens: positions 0..8 score tokens 1..9


def request(prompt_logprobs: int | None = 2, resumed: tuple[int, ...] = ()) -> Request:
    return Request("r", PROMPT, SamplingParams(prompt_logprobs=prompt_logprobs), 0, seed=0,
                   token_ids=[*PROMPT, *resumed], output_token_ids=list(resumed))


def score(req: Request, positions: range) -> None:
    """What the engine core records after a step scored `positions`."""
    req.prompt_logprobs.extend([PROMPT[p + 1] for p in positions], [TokenLogprobs(-1.0, [], [])] * len(positions))


def test_each_chunk_scores_its_positions_and_the_last_prompt_position_scores_nothing():
    req = request()
    assert positions_to_score(req, 4) == range(0, 4)  # position 3 scores token 4, the next chunk's first
    score(req, range(0, 4))
    req.num_computed_tokens = 4
    assert positions_to_score(req, 6) == range(4, 9)  # position 9 gives the first sampled token
    score(req, range(4, 9))
    req.num_computed_tokens = 10
    assert not req.scores_prompt


def test_a_preempted_request_scores_only_what_it_had_not():
    req = request()
    score(req, range(0, 6))
    req.num_computed_tokens = 0  # preempted: recomputed from position 0
    assert req.scores_prompt
    assert positions_to_score(req, 4) == range(0)
    req.num_computed_tokens = 4
    assert positions_to_score(req, 4) == range(6, 8)


def test_resumed_tokens_are_not_prompt_and_requests_that_do_not_ask_score_nothing():
    assert positions_to_score(request(resumed=(7, 8, 9)), 13) == range(0, 9)
    plain = request(prompt_logprobs=None)
    assert positions_to_score(plain, 10) == range(0) and not plain.scores_prompt
    one = Request("one", [5], SamplingParams(prompt_logprobs=0), 0, seed=0)
    assert positions_to_score(one, 1) == range(0) and not one.scores_prompt


def test_vllm_shape_puts_the_prompt_token_first_with_its_rank_when_known():
    collected = PromptLogprobs(2)
    collected.extend([7, 8], [TokenLogprobs(-0.5, [7, 3], [-0.5, -1.0]), TokenLogprobs(-4.0, [1, 2], [-0.1, -2.0])])
    got = as_vllm(collected, lambda t: f"<{t}>")
    assert got == [
        None,
        {7: Logprob(-0.5, 1, "<7>"), 3: Logprob(-1.0, 2, "<3>")},
        {8: Logprob(-4.0, None, "<8>"), 1: Logprob(-0.1, 1, "<1>"), 2: Logprob(-2.0, 2, "<2>")},
    ]
    assert list(got[2]) == [8, 1, 2]


def test_generate_cli_asks_for_and_prints_prompt_logprobs():
    from pdserve.proto import pdserve_pb2
    from pdserve.router.fronts.client import Completion, _parser, build_request

    assert build_request(_parser().parse_args(["hi", "--prompt-logprobs", "2"])).sampling_params.prompt_logprobs == 2
    assert not build_request(_parser().parse_args(["hi"])).sampling_params.HasField("prompt_logprobs")
    completion = Completion()
    entry = pdserve_pb2.TokenLogprobs(token_id=4, logprob=-1.0, top=[pdserve_pb2.TopLogprob(token_id=9, logprob=-0.5)])
    completion.add(pdserve_pb2.GenerateResponse(token_ids=[1], prompt_logprobs=[entry]))
    assert completion.as_dict()["prompt_logprobs"] == [{"token_id": 4, "logprob": -1.0, "top": [[9, -0.5]]}]

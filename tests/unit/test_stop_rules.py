"""The token-level stop rule shared by every engine and the router."""

from __future__ import annotations

import pytest

from pdserve.engine.request import FinishReason
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.stop_rules import token_finish_reason

EOS = 0


@pytest.mark.parametrize(
    "token, num_out, params, expected",
    [
        (5, 1, SamplingParams(max_tokens=4), None),
        (EOS, 1, SamplingParams(max_tokens=4), FinishReason.STOP),
        (EOS, 1, SamplingParams(max_tokens=4, ignore_eos=True), None),
        (EOS, 1, SamplingParams(max_tokens=4, min_tokens=2), None),  # min_tokens holds eos back
        (EOS, 2, SamplingParams(max_tokens=4, min_tokens=2), FinishReason.STOP),
        (7, 1, SamplingParams(max_tokens=4, stop_token_ids=[7]), FinishReason.STOP),
        (7, 1, SamplingParams(max_tokens=4, stop_token_ids=[7], ignore_eos=True), FinishReason.STOP),
        (5, 4, SamplingParams(max_tokens=4), FinishReason.LENGTH),
        (EOS, 4, SamplingParams(max_tokens=4, ignore_eos=True), FinishReason.LENGTH),
    ],
)
def test_token_finish_reason(token, num_out, params, expected):
    assert token_finish_reason(token, num_out, 10 + num_out, params, {EOS}, max_model_len=100) is expected


def test_model_length_ends_the_sequence():
    params = SamplingParams(max_tokens=50)
    assert token_finish_reason(5, 3, 99, params, {EOS}, max_model_len=100) is None
    assert token_finish_reason(5, 4, 100, params, {EOS}, max_model_len=100) is FinishReason.LENGTH

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from pdserve.engine.sampler import Sampler, SamplerOutput, SamplingRow, TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams

EOS = 3
NUM_DRAWS = 20_000
# Upper 0.1% points of chi-square by degrees of freedom. The seeds are fixed, so a
# test either always passes or always fails; the tolerance is what a fair sampler meets.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}
PROBS = [0.4, 0.25, 0.2, 0.1, 0.05]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Many tiny batches: intra-op threads only add sync cost, and the CI cores are shared.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def row(
    params: SamplingParams,
    output: Sequence[int] = (),
    prompt: Sequence[int] = (),
    seed: int = 0,
    index: int = 0,
) -> SamplingRow:
    return SamplingRow(params, prompt, output, seed=seed, sample_index=index)


def draw(probs: list[float], params: SamplingParams, num: int = NUM_DRAWS) -> list[int]:
    """Counts of each token over `num` rows of the same logits, each with its own seed."""
    logits = torch.tensor(probs).log().expand(num, -1)
    out = Sampler([EOS])(logits, [row(params, seed=s) for s in range(num)])
    return torch.bincount(torch.tensor(out.token_ids), minlength=len(probs)).tolist()


def assert_distribution(counts: list[int], expected: list[float]) -> None:
    """Tokens with expected probability 0 never drawn; the rest pass a chi-square test."""
    total = sum(counts)
    norm = sum(expected)
    chi2, dof = 0.0, -1
    for count, p in zip(counts, expected):
        if p == 0.0:
            assert count == 0, (counts, expected)
            continue
        want = total * p / norm
        chi2 += (count - want) ** 2 / want
        dof += 1
    assert chi2 < CHI2_999[dof], (chi2, counts, expected)


def test_greedy_is_argmax_in_any_dtype():
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    rows = [row(SamplingParams(temperature=0), seed=s) for s in range(8)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = Sampler([EOS])(logits.to(dtype), rows)
        assert out.token_ids == logits.to(dtype).float().argmax(dim=-1).tolist()
        assert out.logprobs == [None] * 8


def test_samples_follow_the_distribution():
    assert_distribution(draw(PROBS, SamplingParams()), PROBS)


def test_one_stream_over_positions_follows_the_distribution():
    # One request's successive steps (position = len(output)) are independent draws.
    params = SamplingParams()
    logits = torch.tensor(PROBS).log().expand(NUM_DRAWS, -1)
    rows = [row(params, output=range(pos), seed=123) for pos in range(NUM_DRAWS)]
    out = Sampler([EOS])(logits, rows)
    assert_distribution(torch.bincount(torch.tensor(out.token_ids), minlength=5).tolist(), PROBS)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_log_probs(temperature):
    expected = [p ** (1 / temperature) for p in PROBS]
    assert_distribution(draw(PROBS, SamplingParams(temperature=temperature)), expected)


def test_top_k_keeps_exactly_the_k_most_likely():
    probs = [0.1, 0.4, 0.05, 0.25, 0.2]
    assert_distribution(draw(probs, SamplingParams(top_k=2)), [0, 0.4, 0, 0.25, 0])
    assert draw(probs, SamplingParams(top_k=1), num=200) == [0, 200, 0, 0, 0]


def test_top_k_larger_than_vocab_is_a_no_op():
    assert_distribution(draw(PROBS, SamplingParams(top_k=50)), PROBS)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # Mass before each token: 0, .4, .65, .85, .95 -> p=0.7 keeps the first three.
    assert_distribution(draw(PROBS, SamplingParams(top_p=0.7)), [0.4, 0.25, 0.2, 0, 0])
    assert draw(PROBS, SamplingParams(top_p=0.3), num=200) == [200, 0, 0, 0, 0]


def test_top_p_applies_after_temperature_and_top_k():
    # top_k=4 renormalises to (.4, .25, .2, .1)/.95; mass before: 0, .42, .68, .89.
    # top_p=0.6 keeps two tokens; temperature 0.5 squares the probabilities first:
    # (.16, .0625, .04, .01)/.2725 -> mass before 0, .587, .817 -> keeps the same two.
    params = SamplingParams(top_k=4, top_p=0.6)
    assert_distribution(draw(PROBS, params), [0.4, 0.25, 0, 0, 0])
    # top_k=3 renormalises to (.47, .29, .24): mass before the second is .47, so
    # top_p=0.45 keeps one token (on the raw distribution it would keep two).
    assert draw(PROBS, SamplingParams(top_k=3, top_p=0.45), num=200) == [200, 0, 0, 0, 0]
    params = SamplingParams(top_k=4, top_p=0.6, temperature=0.5)
    assert_distribution(draw(PROBS, params), [0.16, 0.0625, 0, 0, 0])
    params = SamplingParams(top_k=4, top_p=0.7, temperature=2.0)
    scaled = [p**0.5 for p in PROBS[:4]]  # .632 .5 .447 .316 -> mass before 0, .33, .59
    assert_distribution(draw(PROBS, params), scaled[:3] + [0, 0])


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    # Threshold 0.3 * 0.4 = 0.12 keeps 0.4, 0.25 and 0.2.
    assert_distribution(draw(PROBS, SamplingParams(min_p=0.3)), [0.4, 0.25, 0.2, 0, 0])


def test_rows_keep_their_own_truncation_in_a_mixed_batch():
    logits = torch.tensor(PROBS).log().expand(3 * 3000, -1)
    settings = [SamplingParams(top_k=2), SamplingParams(top_p=0.7), SamplingParams(min_p=0.3)]
    rows = [row(settings[i % 3], seed=i) for i in range(3 * 3000)]
    tokens = torch.tensor(Sampler([EOS])(logits, rows).token_ids).view(3000, 3)
    assert tokens[:, 0].max() <= 1 and tokens[:, 1].max() <= 2 and tokens[:, 2].max() <= 2
    assert set(tokens[:, 1].tolist()) == {0, 1, 2}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -0.5, 0.0]])
    params = SamplingParams(repetition_penalty=2.0)
    rows = [row(params, prompt=[0, 1, 1], output=[5, 4])]
    got = Sampler([EOS]).process_logits(logits, rows)
    assert got.tolist() == [[1.0, -2.0, 0.5, 1.0, -1.0, 0.0]]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 5)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    rows = [row(params, prompt=[4, 4, 4], output=[1, 1, 1, 2])]
    got = Sampler([EOS]).process_logits(logits, rows)
    assert got.tolist() == [[0.0, -1.75, -0.75, 0.0, 0.0]]


def test_penalties_stack_in_order_and_touch_only_their_rows():
    logits = torch.tensor([[3.0, 1.0, 1.0], [3.0, 1.0, 1.0]])
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0)
    rows = [row(params, prompt=[1], output=[0, 0]), row(SamplingParams(), prompt=[1], output=[0, 0])]
    got = Sampler([EOS]).process_logits(logits, rows)
    assert got.tolist() == [pytest.approx([3.0 / 1.5 - 2.0, 1.0 / 1.5, 1.0]), [3.0, 1.0, 1.0]]


def test_penalty_changes_the_greedy_token():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert Sampler([EOS])(logits, [row(params, prompt=[0])]).token_ids == [1]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 9.0, 0.0, 10.0, 1.0]])  # eos (3) then stop id (1) lead
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1, 99])
    sampler = Sampler([EOS])
    assert sampler(logits, [row(params, output=[0])]).token_ids == [4]
    assert sampler(logits, [row(params, output=[0, 0])]).token_ids == [EOS]
    ignoring = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1], ignore_eos=True)
    assert sampler(logits, [row(ignoring, output=[])]).token_ids == [EOS]
    assert Sampler([EOS, 1])(logits, [row(SamplingParams(temperature=0, min_tokens=1))]).token_ids == [4]


def test_min_tokens_mask_applies_to_random_rows():
    logits = torch.tensor([[0.0, 5.0, 0.0, 5.0]]).expand(500, -1)
    params = SamplingParams(min_tokens=1, stop_token_ids=[1])
    out = Sampler([EOS])(logits, [row(params, seed=s) for s in range(500)])
    assert set(out.token_ids) == {0, 2}


def varied_rows(target: SamplingRow, num_others: int) -> list[SamplingRow]:
    """`target` among rows that differ in every other way: seed, position, params."""
    settings = [
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(top_p=0.5, top_k=7),
        SamplingParams(min_p=0.2, repetition_penalty=1.3, logprobs=2),
    ]
    others = [
        row(settings[i % 4], output=[i] * (i % 5), prompt=[1, 2], seed=1000 + i) for i in range(num_others)
    ]
    return others[: num_others // 2] + [target] + others[num_others // 2 :]


TARGET_PARAMS = [
    SamplingParams(),
    SamplingParams(top_k=50, temperature=0.7),  # alone: top-k path; in the batch: the sort
    SamplingParams(top_p=0.9, min_p=0.01),
]


@pytest.mark.parametrize("params", TARGET_PARAMS)
def test_same_seed_index_and_position_give_the_same_token_in_any_batch(params):
    torch.manual_seed(0)
    vocab = 1000
    base = torch.randn(vocab) * 0.5  # flat enough that the draw, not the logits, decides
    sampler = Sampler([EOS])
    for pos in range(12):
        target = row(params, output=[5] * pos, seed=7, index=1)
        alone = sampler(base.unsqueeze(0), [target]).token_ids[0]
        for num_others in (3, 8):
            batch = varied_rows(target, num_others)
            at = batch.index(target)
            logits = torch.randn(len(batch), vocab)
            logits[at] = base
            assert sampler(logits, batch).token_ids[at] == alone
            assert sampler(logits.flip(0), batch[::-1]).token_ids[len(batch) - 1 - at] == alone


def stream(seed: int, index: int, length: int, vocab: int = 1000) -> list[int]:
    logits = torch.zeros(length, vocab)
    rows = [row(SamplingParams(), output=range(pos), seed=seed, index=index) for pos in range(length)]
    return Sampler([EOS])(logits, rows).token_ids


def test_streams_differ_by_sample_index_seed_and_position():
    a, b, c = stream(1, 0, 200), stream(1, 1, 200), stream(2, 0, 200)
    assert a == stream(1, 0, 200)
    # Uniform over 1000 tokens: two independent streams agree on ~0.2 of 200 steps.
    assert sum(x == y for x, y in zip(a, b)) <= 3
    assert sum(x == y for x, y in zip(a, c)) <= 3
    assert len(set(a)) > 150  # successive positions draw fresh noise


def test_stream_is_pinned():
    # Prefill and decode nodes (and versions) must agree on the noise for a seed.
    assert stream(42, 0, 8) == PINNED_STREAM


PINNED_STREAM = [406, 3, 353, 125, 527, 309, 647, 734]


def test_logprobs_come_from_raw_logits():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(logprobs=5, temperature=0.3, top_k=3, repetition_penalty=1.7),
        SamplingParams(),
        SamplingParams(logprobs=0),
        SamplingParams(logprobs=2, temperature=0, min_tokens=4, presence_penalty=1.0),
    ]
    rows = [row(p, prompt=[1, 2, 3], output=[4, 5], seed=i) for i, p in enumerate(params)]
    out = Sampler([EOS])(logits.to(torch.bfloat16), rows)
    raw = logits.to(torch.bfloat16).float().log_softmax(dim=-1)
    assert out.logprobs[1] is None
    for i, num in ((0, 5), (2, 0), (3, 2)):
        lp = out.logprobs[i]
        assert isinstance(lp, TokenLogprobs)
        top = raw[i].topk(num)
        assert lp.top_token_ids == top.indices.tolist()
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
        assert lp.token_logprob == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
    assert out.logprobs[2].top_token_ids == [] and out.logprobs[2].top_logprobs == []


def test_logprobs_larger_than_vocab_returns_whole_vocab():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = Sampler([EOS])(logits, [row(SamplingParams(logprobs=20, temperature=0))])
    lp = out.logprobs[0]
    assert lp.top_token_ids == [2, 1, 0]
    assert math.fsum(math.exp(v) for v in lp.top_logprobs) == pytest.approx(1.0)
    assert lp.token_logprob == lp.top_logprobs[0]


def test_input_logits_are_not_modified():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    params = SamplingParams(repetition_penalty=2.0, top_k=2, min_tokens=1)
    Sampler([EOS])(logits, [row(params, prompt=[0, 1, 2, 3])])
    assert logits.tolist() == [[1.0, 2.0, 3.0, 4.0]]


def test_empty_batch_and_shape_mismatch():
    assert Sampler([EOS])(torch.zeros(0, 10), []) == SamplerOutput(token_ids=[], logprobs=[])
    with pytest.raises(ValueError):
        Sampler([EOS])(torch.zeros(2, 10), [row(SamplingParams())])

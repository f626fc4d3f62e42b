"""`pdserve bench serve`'s pure parts: metric math on hand-computed traces, seeded arrival
schedules, workloads (lengths, clipping, JSONL parsing) and the request it sends."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from pdserve.bench.serve.arrivals import ArrivalProcess, arrival_times
from pdserve.bench.serve.client import ClientOptions
from pdserve.bench.serve.grpc_backend import generate_request
from pdserve.bench.serve.metrics import RequestTrace, Slo, describe, percentile, request_metrics, summarize
from pdserve.bench.serve.workloads import (
    ChatLengths, FixedLengths, LogNormal, ModelLimits, RequestSpec, SyntheticWorkload, UniformLengths,
    WorkloadError, read_jsonl,
)
from pdserve.proto import pdserve_pb2

# --------------------------------------------------------------------------- metrics


def trace(index, sent, chunks, end, status="OK", input_len=10):
    return RequestTrace(index=index, due_s=sent, expected_output_len=sum(c for _, c in chunks) or 4,
                        input_len=input_len, sent_s=sent, chunks=list(chunks), end_s=end, status=status)


# A: one token per response but a 2-token response in the middle.
A = trace(0, 1.0, [(1.5, 1), (1.7, 1), (2.0, 2), (2.1, 1)], 2.2, input_len=10)
# B: the first response carries 3 tokens.
B = trace(1, 0.0, [(0.4, 3), (1.0, 1)], 1.05, input_len=20)
# C: a 1-token output.
C = trace(2, 0.0, [(0.3, 1)], 0.35, input_len=30)
# D: failed before any token.
D = trace(3, 0.5, [], 0.6, status="UNAVAILABLE", input_len=40)


def test_ttft_tpot_itl_e2e_of_a_trace_with_a_multi_token_response():
    m = request_metrics(A)
    assert m.ttft_s == pytest.approx(0.5)
    assert m.tpot_s == pytest.approx(0.6 / 4)
    assert m.itl_s == pytest.approx((0.2, 0.15, 0.15, 0.1))  # the 2-token response's 0.3 s spread over both
    assert sum(m.itl_s) == pytest.approx(m.tpot_s * (m.output_len - 1))
    assert m.e2e_s == pytest.approx(1.2)
    assert (m.output_len, m.input_len, m.status, m.ok) == (5, 10, "OK", True)


def test_tokens_that_come_with_the_first_have_zero_gaps():
    m = request_metrics(B)
    assert m.ttft_s == pytest.approx(0.4)
    assert m.itl_s == pytest.approx((0.0, 0.0, 0.6))
    assert m.tpot_s == pytest.approx(0.2)
    assert m.output_len == 4


def test_a_one_token_output_has_no_tpot_and_a_failure_no_latencies():
    one = request_metrics(C)
    assert (one.ttft_s, one.tpot_s, one.itl_s) == (pytest.approx(0.3), None, ())
    failed = request_metrics(D)
    assert (failed.ok, failed.status, failed.ttft_s, failed.tpot_s, failed.output_len) == (False, "UNAVAILABLE", None,
                                                                                             None, 0)
    assert failed.e2e_s == pytest.approx(0.1)


def test_percentiles_interpolate_linearly_between_ranks():
    assert percentile([5, 1, 4, 2, 3], 50) == 3
    assert percentile([1, 2, 3, 4, 5], 90) == pytest.approx(4.6)
    assert percentile([1, 2, 3, 4, 5], 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0
    assert describe([]) is None
    d = describe([0.5, 0.4, 0.3])
    assert (d.count, d.mean, d.p50, d.p90, d.p99) == (3, pytest.approx(0.4), pytest.approx(0.4), pytest.approx(0.48),
                                                       pytest.approx(0.498))


def test_summary_attainment_goodput_and_throughput():
    metrics = [request_metrics(t) for t in (A, B, C, D)]
    s = summarize(metrics, Slo(ttft_s=0.45, tpot_s=0.16), duration_s=2.2)
    # A misses TTFT (0.5), B misses TPOT (0.2), C meets both (no TPOT), D failed: a miss of both.
    assert (s.attainment, s.ttft_attainment, s.tpot_attainment) == (0.25, 0.5, 0.5)
    assert s.goodput == pytest.approx(1 / 2.2)
    assert (s.num_requests, s.num_ok, s.statuses) == (4, 3, {"OK": 3, "UNAVAILABLE": 1})
    assert s.request_throughput == pytest.approx(3 / 2.2)
    assert s.output_token_throughput == pytest.approx(10 / 2.2)
    assert s.input_token_throughput == pytest.approx(60 / 2.2)
    assert s.ttft_s.count == 3 and s.ttft_s.mean == pytest.approx(0.4)
    assert s.tpot_s.count == 2 and s.tpot_s.mean == pytest.approx(0.175)
    assert s.itl_s.count == 7 and s.e2e_s.count == 3


def test_unset_slos_are_met_by_every_ok_request_and_never_by_a_failed_one():
    metrics = [request_metrics(t) for t in (A, B, C, D)]
    s = summarize(metrics, Slo(), duration_s=2.0)
    assert (s.attainment, s.ttft_attainment, s.tpot_attainment, s.goodput) == (0.75, 0.75, 0.75, 1.5)
    assert summarize([], Slo(), 0.0).attainment == 0.0


# --------------------------------------------------------------------------- arrivals


def intervals(times):
    return np.diff([0.0, *times])


def test_poisson_arrivals_have_the_mean_rate_and_cv_one():
    gaps = intervals(arrival_times(ArrivalProcess(rate=5.0), seed=3, num_requests=20_000))
    assert 1 / gaps.mean() == pytest.approx(5.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_arrivals_have_the_mean_rate_and_the_asked_cv(cv):
    gaps = intervals(arrival_times(ArrivalProcess(rate=2.0, cv=cv), seed=1, num_requests=40_000))
    assert 1 / gaps.mean() == pytest.approx(2.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)


def test_schedules_are_determined_by_the_seed_and_scale_with_the_rate():
    one = arrival_times(ArrivalProcess(4.0, 2.0), seed=7, num_requests=50)
    assert one == arrival_times(ArrivalProcess(4.0, 2.0), seed=7, num_requests=50)
    assert one != arrival_times(ArrivalProcess(4.0, 2.0), seed=8, num_requests=50)
    assert arrival_times(ArrivalProcess(8.0, 2.0), seed=7, num_requests=50) == pytest.approx([t / 2 for t in one])
    assert all(b > a for a, b in itertools.pairwise(one))


def test_a_duration_schedule_is_the_count_schedule_cut_at_the_duration():
    by_duration = arrival_times(ArrivalProcess(10.0), seed=0, duration_s=30.0)
    by_count = arrival_times(ArrivalProcess(10.0), seed=0, num_requests=len(by_duration) + 1)
    assert by_duration == by_count[:-1]
    assert by_duration[-1] <= 30.0 < by_count[-1]
    assert len(by_duration) == pytest.approx(300, rel=0.15)
    assert arrival_times(ArrivalProcess(float("inf")), seed=0, num_requests=3) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("make", [
    lambda: ArrivalProcess(0.0),
    lambda: ArrivalProcess(1.0, cv=0.0),
    lambda: arrival_times(ArrivalProcess(1.0), seed=0),
    lambda: arrival_times(ArrivalProcess(1.0), seed=0, num_requests=3, duration_s=1.0),
    lambda: arrival_times(ArrivalProcess(1.0), seed=0, num_requests=0),
])
def test_bad_arrival_parameters_are_refused(make):
    with pytest.raises(ValueError):
        make()


# --------------------------------------------------------------------------- workloads

LIMITS = ModelLimits(vocab_size=50, max_model_len=256, eos_token_ids=(0, 7))


def test_fixed_lengths_give_exact_lengths_and_ids_from_the_vocab_without_eos():
    workload = SyntheticWorkload(FixedLengths(12, 5), LIMITS, seed=0)
    specs = [workload.request(i) for i in range(200)]
    assert {(s.input_len, s.output_len) for s in specs} == {(12, 5)}
    ids = {t for s in specs for t in s.token_ids}
    assert ids <= set(range(50)) - {0, 7} and len(ids) > 40
    assert workload.request(3) == SyntheticWorkload(FixedLengths(12, 5), LIMITS, seed=0).request(3)
    assert workload.request(3) != SyntheticWorkload(FixedLengths(12, 5), LIMITS, seed=1).request(3)


def test_uniform_lengths_stay_in_their_inclusive_ranges_and_reach_both_ends():
    workload = SyntheticWorkload(UniformLengths((3, 6), (1, 4)), LIMITS, seed=2)
    pairs = [(s.input_len, s.output_len) for s in (workload.request(i) for i in range(400))]
    assert {i for i, _ in pairs} == {3, 4, 5, 6}
    assert {o for _, o in pairs} == {1, 2, 3, 4}


@pytest.mark.parametrize("lengths", [FixedLengths(200, 57), UniformLengths((10, 20), (200, 250)),
                                     UniformLengths((5, 4), (1, 2)), FixedLengths(0, 3)])
def test_lengths_that_cannot_fit_the_model_are_refused(lengths):
    with pytest.raises(WorkloadError):
        SyntheticWorkload(lengths, LIMITS, seed=0)


def test_chat_lengths_are_clipped_to_the_model():
    workload = SyntheticWorkload(ChatLengths(max_model_len=64), ModelLimits(50, 64), seed=0)
    pairs = [(s.input_len, s.output_len) for s in (workload.request(i) for i in range(500))]
    assert all(1 <= i <= 63 and o >= 1 and i + o <= 64 for i, o in pairs)
    assert any(i == 63 for i, _ in pairs), "long prompts were clipped"
    assert any(i + o == 64 for i, o in pairs), "long outputs were clipped to the room left"


def test_chat_lengths_have_their_means_when_the_model_is_long():
    rng = np.random.default_rng(0)
    chat = ChatLengths(max_model_len=1 << 20, input=LogNormal(161.31, 1.0), output=LogNormal(337.99, 1.0))
    pairs = np.array([chat.sample(rng) for _ in range(20_000)])
    assert pairs[:, 0].mean() == pytest.approx(161.31, rel=0.05)
    assert pairs[:, 1].mean() == pytest.approx(337.99, rel=0.05)
    assert np.median(pairs[:, 0]) == pytest.approx(161.31 * np.exp(-0.5), rel=0.05)


def test_jsonl_is_read_in_order_and_starts_over(tmp_path):
    path = tmp_path / "traffic.jsonl"
    path.write_text('{"prompt": "hello there", "output_len": 3}\n\n{"prompt": "second", "output_len": 1}\n')
    workload = read_jsonl(path)
    assert [(workload.request(i).text, workload.request(i).output_len) for i in range(3)] == [
        ("hello there", 3), ("second", 1), ("hello there", 3)]
    assert workload.request(0).token_ids is None and workload.request(0).input_len is None


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not JSON"),
    ('["prompt", 3]', "expected an object"),
    ('{"prompt": "", "output_len": 3}', '"prompt" must be a non-empty string'),
    ('{"prompt": "x"}', '"output_len" must be an integer >= 1, got None'),
    ('{"prompt": "x", "output_len": 0}', '"output_len" must be an integer >= 1, got 0'),
    ('{"prompt": "x", "output_len": true}', '"output_len" must be an integer >= 1, got True'),
    ('{"prompt": "x", "output_len": 2.5}', '"output_len" must be an integer >= 1, got 2.5'),
])
def test_a_bad_jsonl_line_is_named_with_its_line_number(tmp_path, bad, message):
    path = tmp_path / "traffic.jsonl"
    path.write_text(json.dumps({"prompt": "fine", "output_len": 2}) + "\n" + bad + "\n")
    with pytest.raises(WorkloadError) as err:
        read_jsonl(path)
    assert str(err.value).startswith(f"{path}:2: {message}")


def test_an_empty_jsonl_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(WorkloadError, match="no requests"):
        read_jsonl(path)


# --------------------------------------------------------------------------- the request sent


def test_requests_ask_for_exactly_output_len_greedy_tokens():
    ids = SyntheticWorkload(FixedLengths(4, 9), LIMITS, seed=0).request(0)
    request = generate_request(ids)
    assert request.WhichOneof("prompt") == "token_ids" and list(request.token_ids.ids) == list(ids.token_ids)
    params = request.sampling_params
    assert (params.max_tokens, params.ignore_eos, params.temperature) == (9, True, 0.0)
    text = generate_request(RequestSpec(output_len=2, text="hi"))
    assert (text.WhichOneof("prompt"), text.text, text.sampling_params.max_tokens) == ("text", "hi", 2)
    assert isinstance(request, pdserve_pb2.GenerateRequest)


def test_the_auth_token_travels_as_a_bearer_authorization_header():
    assert ClientOptions(auth_token="s3cret").metadata() == (("authorization", "Bearer s3cret"),)
    assert ClientOptions().metadata() == ()


def test_every_run_sends_the_same_lengths_with_fresh_prompt_tokens():
    workload = SyntheticWorkload(UniformLengths((4, 40), (1, 9)), LIMITS, seed=0)
    first = [workload.request(i, run=0) for i in range(20)]
    second = [workload.request(i, run=1) for i in range(20)]
    assert [(a.input_len, a.output_len) for a in first] == [(b.input_len, b.output_len) for b in second]
    assert all(a.token_ids != b.token_ids for a, b in zip(first, second) if a.input_len > 2)

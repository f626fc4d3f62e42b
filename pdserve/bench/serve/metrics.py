"""Serving metrics: per-request latencies from a token-arrival trace, and a run's summary.

Owns the definitions, in one place:
  TTFT  send → the first response carrying a token.
  TPOT  (last token's arrival − first token's) / (n_out − 1): the mean gap after the first token.
        Undefined (None) for a 1-token output: such a request has no decode phase,
        is left out of the TPOT statistics and counts as meeting any TPOT SLO.
  ITL   every gap between consecutive tokens. A response may carry k > 1 tokens; the
        gap since the previous response is spread evenly over its k tokens (k gaps of
        gap/k), and tokens that came with the first token have gaps of 0. So a request
        has n_out − 1 gaps summing to last token's arrival − first's; their mean is its TPOT.
  E2E   send → the end of the stream.
  attainment  share of all requests (failed ones included, as misses) that are OK and
        meet both SLOs; also for TTFT alone and TPOT alone. An SLO left unset is met.
  goodput  requests meeting both SLOs per second of the run (from its start, time 0,
        to its last stream's end). The rate a cluster sustains at a target attainment
        (DistServe's goodput) is what `sweep` finds.
Pure: times in, numbers out. Never reads a clock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

OK = "OK"


@dataclass(slots=True)
class RequestTrace:
    """What the client saw of one request; times are seconds from the run's start."""

    index: int
    due_s: float  # when the schedule said to send it
    expected_output_len: int
    input_len: int | None = None  # the prompt's ids, or the server's usage.prompt_tokens for text
    sent_s: float | None = None
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) per response with tokens
    end_s: float | None = None
    status: str = OK  # "OK" or the gRPC status code's name
    error: str = ""
    request_id: str = ""


@dataclass(frozen=True)
class RequestMetrics:
    index: int
    status: str
    input_len: int | None
    output_len: int
    expected_output_len: int
    due_s: float
    send_lag_s: float | None  # how late the client sent it against its due time
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    itl_s: tuple[float, ...]
    error: str
    request_id: str

    @property
    def ok(self) -> bool:
        return self.status == OK


def inter_token_gaps(first_s: float, chunks: list[tuple[float, int]]) -> list[float]:
    """n_out − 1 gaps; the first response's extra tokens get 0, a later k-token response k × gap/k."""
    gaps = [0.0] * (chunks[0][1] - 1)
    previous = first_s
    for at, count in chunks[1:]:
        gaps.extend([(at - previous) / count] * count)
        previous = at
    return gaps


def request_metrics(trace: RequestTrace) -> RequestMetrics:
    output_len = sum(count for _, count in trace.chunks)
    ttft = tpot = e2e = None
    itl: list[float] = []
    if trace.sent_s is not None and trace.chunks:
        first_at, last_at = trace.chunks[0][0], trace.chunks[-1][0]
        ttft = first_at - trace.sent_s
        itl = inter_token_gaps(first_at, trace.chunks)
        if output_len > 1:
            tpot = (last_at - first_at) / (output_len - 1)
    if trace.sent_s is not None and trace.end_s is not None:
        e2e = trace.end_s - trace.sent_s
    return RequestMetrics(
        index=trace.index, status=trace.status, input_len=trace.input_len, output_len=output_len,
        expected_output_len=trace.expected_output_len, due_s=trace.due_s,
        send_lag_s=None if trace.sent_s is None else trace.sent_s - trace.due_s,
        ttft_s=ttft, tpot_s=tpot, e2e_s=e2e, itl_s=tuple(itl), error=trace.error, request_id=trace.request_id,
    )


# --------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class Slo:
    """Latency objectives in seconds; None leaves that one unconstrained."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def meets_ttft(self, m: RequestMetrics) -> bool:
        return m.ok and m.ttft_s is not None and (self.ttft_s is None or m.ttft_s <= self.ttft_s)

    def meets_tpot(self, m: RequestMetrics) -> bool:
        # A 1-token output has no TPOT: nothing after the first token can be late.
        return m.ok and (self.tpot_s is None or m.tpot_s is None or m.tpot_s <= self.tpot_s)

    def meets(self, m: RequestMetrics) -> bool:
        return self.meets_ttft(m) and self.meets_tpot(m)


@dataclass(frozen=True)
class Distribution:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, linearly interpolated between closest ranks (numpy's default)."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def describe(values: list[float]) -> Distribution | None:
    if not values:
        return None
    return Distribution(len(values), float(np.mean(values)), percentile(values, 50), percentile(values, 90),
                        percentile(values, 99))


@dataclass(frozen=True)
class Summary:
    num_requests: int
    num_ok: int
    statuses: dict[str, int]
    duration_s: float
    request_throughput: float  # OK requests/s
    input_token_throughput: float  # prompt tokens of OK requests/s
    output_token_throughput: float  # generated tokens of OK requests/s
    ttft_s: Distribution | None  # over OK requests
    tpot_s: Distribution | None  # over OK requests with more than one output token
    itl_s: Distribution | None  # over every gap of OK requests
    e2e_s: Distribution | None
    attainment: float  # both SLOs
    ttft_attainment: float
    tpot_attainment: float
    goodput: float  # requests/s meeting both SLOs
    max_send_lag_s: float  # > 0 by much means the client could not keep the schedule

    @classmethod
    def from_record(cls, record: dict) -> Summary:
        """The summary a run's JSON record holds (report.run_record's `summary`): how a program
        reads what a `pdserve bench serve` of its own measured."""
        distributions = ("ttft_s", "tpot_s", "itl_s", "e2e_s")
        return cls(**{k: (Distribution(**v) if k in distributions and v is not None else v)
                       for k, v in record.items()})


def summarize(metrics: list[RequestMetrics], slo: Slo, duration_s: float) -> Summary:
    ok = [m for m in metrics if m.ok]
    n = len(metrics)
    meeting = sum(slo.meets(m) for m in metrics)
    return Summary(
        num_requests=n,
        num_ok=len(ok),
        statuses=dict(Counter(m.status for m in metrics)),
        duration_s=duration_s,
        request_throughput=_ratio(len(ok), duration_s),
        input_token_throughput=_ratio(sum(m.input_len or 0 for m in ok), duration_s),
        output_token_throughput=_ratio(sum(m.output_len for m in ok), duration_s),
        ttft_s=describe([m.ttft_s for m in ok if m.ttft_s is not None]),
        tpot_s=describe([m.tpot_s for m in ok if m.tpot_s is not None]),
        itl_s=describe([gap for m in ok for gap in m.itl_s]),
        e2e_s=describe([m.e2e_s for m in ok if m.e2e_s is not None]),
        attainment=_ratio(meeting, n),
        ttft_attainment=_ratio(sum(slo.meets_ttft(m) for m in metrics), n),
        tpot_attainment=_ratio(sum(slo.meets_tpot(m) for m in metrics), n),
        goodput=_ratio(meeting, duration_s),
        max_send_lag_s=max((m.send_lag_s for m in metrics if m.send_lag_s is not None), default=0.0),
    )


def _ratio(amount: float, over: float) -> float:
    return amount / over if over > 0 else 0.0


def run_duration(traces: list[RequestTrace]) -> float:
    """From the run's start (time 0) to the last stream's end."""
    return max((t.end_s for t in traces if t.end_s is not None), default=0.0)

"""The goodput search of `pdserve bench serve`: bisection on a pure function, then the real
open-loop client against an in-process fake `Generation` server whose latencies are a known
function of the offered rate, so the rate the sweep must find is known analytically.

The fake (a seam fake: a real grpc.aio server on loopback, in a thread of its own) also
checks what the client must get right whatever the timings: the auth header, a failed
call recorded with its status code, a per-request deadline, exact token counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from dataclasses import dataclass

import grpc
import pytest

from pdserve.bench.serve import cli, report
from pdserve.bench.serve.client import ClientOptions
from pdserve.bench.serve.grpc_backend import GrpcBackend
from pdserve.bench.serve.metrics import Slo
from pdserve.bench.serve.runner import RunLength, ServeBench
from pdserve.bench.serve.sweep import SweepConfig, find_max_rate
from pdserve.bench.serve.workloads import FixedLengths, ModelLimits, RequestSpec, SyntheticWorkload
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

# --------------------------------------------------------------------------- pure bisection


@dataclass(frozen=True)
class Measured:
    attainment: float


def step_at(threshold: float, calls: list[float]):
    def run_at(rate: float) -> Measured:
        calls.append(rate)
        return Measured(1.0 if rate <= threshold else 0.5)
    return run_at


def test_automatic_bracket_doubles_then_bisects_to_the_tolerance():
    calls: list[float] = []
    sweep = find_max_rate(step_at(6.3, calls), SweepConfig(start_rate=1.0, tolerance=0.05))
    assert calls[:4] == [1.0, 2.0, 4.0, 8.0]
    assert sweep.converged and sweep.best_rate <= 6.3 < sweep.failed_rate
    assert sweep.failed_rate - sweep.best_rate <= 0.05 * sweep.failed_rate
    assert [p.rate for p in sweep.probes] == calls
    assert [p.passed for p in sweep.probes] == [r <= 6.3 for r in calls]


def test_automatic_bracket_halves_from_a_start_that_misses():
    calls: list[float] = []
    sweep = find_max_rate(step_at(6.3, calls), SweepConfig(start_rate=100.0, tolerance=0.1))
    assert calls[:5] == [100.0, 50.0, 25.0, 12.5, 6.25]
    assert sweep.converged and sweep.best_rate <= 6.3 < sweep.failed_rate


def test_a_smaller_growth_brackets_a_start_near_the_answer_in_a_narrow_step():
    """From a prediction 10% under the answer, steps of a quarter: the second probe misses, and
    the bracket is 20% wide after two probes (doubling: 50%)."""
    calls: list[float] = []
    sweep = find_max_rate(step_at(6.3, calls), SweepConfig(start_rate=5.7, tolerance=0.02, max_probes=4, growth=1.25))
    assert calls[:2] == pytest.approx([5.7, 7.125])
    assert calls[2:] == pytest.approx([(5.7 + 7.125) / 2, (5.7 + 6.4125) / 2])
    assert sweep.best_rate == pytest.approx(6.05625) and sweep.failed_rate == pytest.approx(6.4125)
    with pytest.raises(ValueError, match="growth"):
        SweepConfig(growth=1.0)


def test_a_given_bracket_is_bisected():
    calls: list[float] = []
    sweep = find_max_rate(step_at(6.3, calls), SweepConfig(rate_min=2.0, rate_max=10.0, tolerance=0.1))
    assert calls[:3] == [2.0, 10.0, 6.0]
    assert sweep.converged and 6.3 - 0.1 * 10 <= sweep.best_rate <= 6.3 < sweep.failed_rate


def test_a_missing_rate_min_or_a_passing_rate_max_ends_the_sweep_unconverged():
    calls: list[float] = []
    low_fails = find_max_rate(step_at(1.0, calls), SweepConfig(rate_min=2.0, rate_max=10.0))
    assert (calls, low_fails.best_rate, low_fails.failed_rate, low_fails.converged) == ([2.0], None, 2.0, False)
    calls.clear()
    high_passes = find_max_rate(step_at(50.0, calls), SweepConfig(rate_min=2.0, rate_max=10.0))
    assert (calls, high_passes.best_rate, high_passes.failed_rate, high_passes.converged) == ([2.0, 10.0], 10.0, None,
                                                                                            False)
    calls.clear()
    capped = find_max_rate(step_at(50.0, calls), SweepConfig(start_rate=1.0, rate_max=5.0))
    assert (calls, capped.best_rate, capped.converged) == ([1.0, 2.0, 4.0, 5.0], 5.0, False)


def test_the_probe_budget_is_respected():
    calls: list[float] = []
    sweep = find_max_rate(step_at(6.3, calls), SweepConfig(start_rate=1.0, tolerance=0.001, max_probes=6))
    assert len(calls) == 6 and not sweep.converged
    assert sweep.best_rate <= 6.3 < sweep.failed_rate


@pytest.mark.parametrize("bad", [{"target_attainment": 0.0}, {"rate_min": 5.0, "rate_max": 5.0}, {"tolerance": 1.0},
                                 {"max_probes": 1}, {"start_rate": float("inf")}])
def test_bad_sweep_configs_are_refused(bad):
    with pytest.raises(ValueError):
        SweepConfig(**bad)


# --------------------------------------------------------------------------- fake server

# The fake's latencies are step functions of the offered rate it is told: fast up to a
# knee, far slower beyond it, so scheduling noise on a busy machine (tens of ms) cannot
# move a probe across the SLO.
FAST_S = 0.01
SLOW_S = 0.4
TTFT_KNEE = 14.0
TPOT_KNEE = 11.5
SLO_S = 0.2
FAIL_TOKEN = 3  # a prompt holding this id is refused
HANG_TOKEN = 4  # a prompt holding this id never answers
VOCAB = 100


class FakeGeneration(pdserve_pb2_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.offered_rate = 1.0
        self.auth_headers: list[str | None] = []

    async def GetModelInfo(self, request, context):
        # The scripted ids pose as end-of-sequence ids, so synthetic prompts never hold them.
        return pdserve_pb2.ModelInfo(model="fake", vocab_size=VOCAB, max_model_len=512,
                                     eos_token_ids=[0, FAIL_TOKEN, HANG_TOKEN])

    async def Generate(self, request, context):
        self.auth_headers.append(dict(context.invocation_metadata()).get("authorization"))
        ids = list(request.token_ids.ids)
        if FAIL_TOKEN in ids:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free blocks")
        if HANG_TOKEN in ids:
            await asyncio.sleep(60)
        rate = self.offered_rate
        await asyncio.sleep(FAST_S if rate <= TTFT_KNEE else SLOW_S)
        n = request.sampling_params.max_tokens
        for i in range(n):
            if i:
                await asyncio.sleep(FAST_S if rate <= TPOT_KNEE else SLOW_S)
            last = i == n - 1
            yield pdserve_pb2.GenerateResponse(
                request_id="fake", token_ids=[10 + i],
                finish_reason=pdserve_pb2.FINISH_REASON_LENGTH if last else pdserve_pb2.FINISH_REASON_UNSPECIFIED,
                usage=pdserve_pb2.Usage(prompt_tokens=len(ids), completion_tokens=n) if last else None,
            )


@contextlib.contextmanager
def fake_router():
    """The fake on 127.0.0.1 in its own thread and event loop; yields (servicer, address)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servicer = FakeGeneration()

    async def start():
        server = grpc.aio.server()
        pdserve_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


class Scripted:
    """A workload of fixed requests, for the failure cases."""

    def __init__(self, specs: list[RequestSpec]) -> None:
        self._specs = specs

    def request(self, index: int, run: int = 0) -> RequestSpec:
        return self._specs[index]


def test_sweep_finds_the_rate_where_the_fakes_tpot_crosses_the_slo(tmp_path):
    # TTFT meets its SLO up to 14 req/s, TPOT up to 11.5: the answer is 11.5. From 8 the
    # sweep probes 8, 16, 12, 10 and stops.
    slo = Slo(ttft_s=SLO_S, tpot_s=SLO_S)
    tolerance = 0.2
    limits = ModelLimits(VOCAB, 512, (0, FAIL_TOKEN, HANG_TOKEN))  # keep the scripted ids out
    with fake_router() as (fake, address):
        bench = ServeBench(GrpcBackend(address, ClientOptions(progress=False)),
                           SyntheticWorkload(FixedLengths(6, 3), limits, seed=0), RunLength(num_requests=6),
                           cv=1.0, seed=0, slo=slo)

        def run_at(rate):
            fake.offered_rate = rate
            return bench.run_at(rate)

        # Half the requests must meet the SLOs: one slow request on a busy machine moves no probe.
        sweep = find_max_rate(run_at, SweepConfig(target_attainment=0.5, start_rate=8.0, tolerance=tolerance))

    assert sweep.converged
    assert sweep.best_rate == pytest.approx(11.5, rel=tolerance)
    assert sweep.best_rate < sweep.failed_rate <= sweep.best_rate / (1 - tolerance)
    for probe in sweep.probes:
        summary = probe.result.summary
        assert summary.statuses == {"OK": 6}
        assert [m.output_len for m in probe.result.requests] == [3] * 6
        assert [m.input_len for m in probe.result.requests] == [6] * 6
        assert all(len(m.itl_s) == 2 for m in probe.result.requests)

    record = report.sweep_record(sweep, target=0.5, devices=4)
    assert record["goodput_per_device"] == sweep.best_rate / 4
    assert [p["rate"] for p in record["probes"]] == [p.rate for p in sweep.probes]
    runs = [p.result for p in sweep.probes]
    out = tmp_path / "sweep.json"
    report.write_json(out, {"sweep": True}, {"model": "fake"}, runs, record)
    doc = json.loads(out.read_text())
    assert len(doc["runs"]) == len(runs) and len(doc["runs"][0]["requests"]) == 6
    for path in report.write_plots(tmp_path / "plots", runs, target=0.5, slo=slo):
        assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_failures_and_deadlines_are_recorded_per_request_and_the_token_is_sent():
    specs = [RequestSpec(output_len=2, token_ids=(10, 11)), RequestSpec(output_len=2, token_ids=(FAIL_TOKEN,)),
             RequestSpec(output_len=2, token_ids=(HANG_TOKEN,)), RequestSpec(output_len=1, token_ids=(12,))]
    options = ClientOptions(timeout_s=1.0, auth_token="s3cret", progress=False)
    with fake_router() as (fake, address):
        fake.offered_rate = 0.1
        bench = ServeBench(GrpcBackend(address, options), Scripted(specs), RunLength(num_requests=4), 1.0, 0, Slo())
        run = bench.run_at(50.0)
    assert [m.status for m in run.requests] == ["OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "OK"]
    assert run.requests[1].error == "no free blocks"
    assert [m.output_len for m in run.requests] == [2, 0, 0, 1]
    assert run.summary.statuses == {"OK": 2, "RESOURCE_EXHAUSTED": 1, "DEADLINE_EXCEEDED": 1}
    assert run.summary.attainment == 0.5  # no SLO set: exactly the OK requests meet it
    assert fake.auth_headers == ["Bearer s3cret"] * 4


def test_the_command_line_sweep_records_every_probe_and_goodput_per_device(tmp_path):
    token_file, out = tmp_path / "token", tmp_path / "sweep.json"
    token_file.write_text("s3cret\n")
    argv = ["--sweep", "--start-rate", "4", "--rate-max", "8", "--num-requests", "4", "--input-len", "5",
            "--output-len", "2", "--ttft-slo", "5", "--tpot-slo", "5", "--devices", "2",
            "--auth-token-file", str(token_file), "--no-progress", "--output-json", str(out)]
    with fake_router() as (fake, address):
        fake.offered_rate = 0.1
        assert cli.main(["--addr", address, *argv]) == 0
    doc = json.loads(out.read_text())
    sweep = doc["sweep"]
    # Both probes meet the SLOs; the sweep stops at --rate-max, unconverged.
    assert [(p["rate"], p["passed"]) for p in sweep["probes"]] == [(4.0, True), (8.0, True)]
    assert (sweep["goodput"], sweep["goodput_per_device"], sweep["converged"]) == (8.0, 4.0, False)
    assert [run["rate"] for run in doc["runs"]] == [4.0, 8.0]
    assert all(r["status"] == "OK" and r["output_len"] == 2 for run in doc["runs"] for r in run["requests"])
    assert fake.auth_headers == ["Bearer s3cret"] * 8
    assert "s3cret" not in out.read_text()


@pytest.mark.parametrize("flags", [
    ["--sweep"],  # no SLO to search against
    ["--rate", "1", "--arrival", "gamma"],  # no --cv
    ["--rate", "1", "--cv", "2"],  # a CV for Poisson arrivals
    ["--rate", "0"],
    ["--rate", "1", "--workload", "uniform", "--input-len-range", "1:4"],
    ["--rate", "1", "--workload", "jsonl"],
    ["--rate", "1", "--rates", "1,2"],
    ["--rate", "1", "--num-requests", "3", "--duration-s", "2"],
    ["--rate", "1", "--input-len-range", "4-8"],
    ["--rates", "1,inf", "--duration-s", "2"],
])
def test_bad_flag_combinations_are_usage_errors(flags):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--addr", "127.0.0.1:1", *flags])
    assert exit_.value.code == 2


def test_an_unreachable_router_is_a_clean_error(capsys):
    assert cli.main(["--addr", "127.0.0.1:1", "--rate", "1", "--no-progress"]) == 1
    assert "error: GetModelInfo at 127.0.0.1:1: UNAVAILABLE" in capsys.readouterr().err

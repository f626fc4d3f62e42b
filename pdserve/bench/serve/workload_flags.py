"""The workload and arrival flags, shared by `pdserve bench serve` and `pdserve plan`, so a
workload is named the same way whether it is measured or predicted.

Owns the flags (`--workload`, its lengths, `--dataset`, `--arrival`, `--cv`, `--num-requests`,
`--min-duration-s`, `--seed`), their checks (a bad combination is a usage error naming the
flag), the `Workload` they build, and the flags written back out (`workload_argv`: how a plan
hands its workload to a `pdserve bench serve` of its own). Pure argparse and workloads.py: never
talks to a server.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.bench.serve.workloads import (
    CHAT_INPUT_MEAN, CHAT_OUTPUT_MEAN, CHAT_SIGMA, ChatLengths, FixedLengths, LogNormal, ModelLimits,
    SyntheticWorkload, UniformLengths, Workload, read_jsonl,
)

DEFAULT_NUM_REQUESTS = 100


def _length_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (two integers), got {text!r}") from None
    return low, high


def add_arrival_args(p: argparse.ArgumentParser, duration: bool = True, min_duration_s: float = 0.0) -> None:
    """`duration`: offer --duration-s beside --num-requests (a real run can be timed; a plan counts
    requests). `min_duration_s`: the default of --min-duration-s (a plan's simulated runs are cheap:
    it makes every one a sustained load)."""
    arrivals = p.add_argument_group("arrivals")
    arrivals.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson")
    arrivals.add_argument("--cv", type=float, help="gamma: coefficient of variation of the intervals (1 = Poisson)")
    length = arrivals.add_mutually_exclusive_group()
    length.add_argument("--num-requests", type=int, help=f"requests per run (default {DEFAULT_NUM_REQUESTS})")
    if duration:
        length.add_argument("--duration-s", type=float, help="send every request due within this many seconds")
    arrivals.add_argument("--min-duration-s", type=float, default=min_duration_s,
                          help="with --num-requests: more requests at high rates, enough that a run's arrivals "
                               "span this many seconds, so it is a sustained load, not a burst "
                               f"(default {min_duration_s:g})")
    arrivals.add_argument("--seed", type=int, default=0, help="seeds the arrivals and the synthetic prompts")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    work = p.add_argument_group("workload")
    work.add_argument("--workload", choices=["fixed", "uniform", "chat", "jsonl"], default="fixed")
    work.add_argument("--input-len", type=int, default=128, help="fixed: prompt tokens")
    work.add_argument("--output-len", type=int, default=128, help="fixed: output tokens")
    work.add_argument("--input-len-range", type=_length_range, help="uniform: A:B prompt tokens, inclusive")
    work.add_argument("--output-len-range", type=_length_range, help="uniform: A:B output tokens, inclusive")
    work.add_argument("--chat-input-mean", type=float, default=CHAT_INPUT_MEAN, help="chat: mean prompt tokens")
    work.add_argument("--chat-output-mean", type=float, default=CHAT_OUTPUT_MEAN, help="chat: mean output tokens")
    work.add_argument("--chat-sigma", type=float, default=CHAT_SIGMA, help="chat: sigma of log(length)")
    work.add_argument("--dataset", type=Path, help='jsonl: lines of {"prompt": TEXT, "output_len": N}')


def check_workload_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse's usage error (exit 2), naming the flag, for a combination that cannot run."""
    if args.arrival == "poisson" and args.cv not in (None, 1.0):
        p.error("--cv is for --arrival gamma (Poisson arrivals have cv 1)")
    if args.arrival == "gamma" and args.cv is None:
        p.error("--arrival gamma needs --cv")
    if args.workload == "uniform" and (args.input_len_range is None or args.output_len_range is None):
        p.error("--workload uniform needs --input-len-range and --output-len-range")
    if args.workload == "jsonl" and args.dataset is None:
        p.error("--workload jsonl needs --dataset")
    if args.num_requests is not None and args.num_requests < 1:
        p.error("--num-requests must be >= 1")
    if not args.min_duration_s >= 0:
        p.error(f"--min-duration-s must be >= 0, got {args.min_duration_s}")
    if args.min_duration_s and getattr(args, "duration_s", None) is not None:
        p.error("--min-duration-s is for --num-requests (--duration-s already sets how long a run lasts)")


def build_workload(args: argparse.Namespace, limits: ModelLimits) -> Workload:
    if args.workload == "jsonl":
        return read_jsonl(args.dataset)
    if args.workload == "fixed":
        lengths = FixedLengths(args.input_len, args.output_len)
    elif args.workload == "uniform":
        lengths = UniformLengths(args.input_len_range, args.output_len_range)
    else:
        lengths = ChatLengths(limits.max_model_len, LogNormal(args.chat_input_mean, args.chat_sigma),
                              LogNormal(args.chat_output_mean, args.chat_sigma))
    return SyntheticWorkload(lengths, limits, args.seed)


def workload_argv(args: argparse.Namespace) -> list[str]:
    """The workload and arrival flags of `args` (parsed by a parser given both groups) as
    `pdserve bench serve` takes them: the same requests on the same arrivals, as many. An unset
    `--num-requests` is written as its default; `--duration-s`, which a plan does not take, never."""
    argv = ["--workload", args.workload, "--arrival", args.arrival, "--seed", str(args.seed),
            "--num-requests", str(args.num_requests or DEFAULT_NUM_REQUESTS),
            "--min-duration-s", repr(args.min_duration_s)]
    if args.cv is not None:
        argv += ["--cv", repr(args.cv)]
    if args.workload == "fixed":
        argv += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    elif args.workload == "uniform":
        argv += ["--input-len-range", "%d:%d" % args.input_len_range,
                 "--output-len-range", "%d:%d" % args.output_len_range]
    elif args.workload == "chat":
        argv += ["--chat-input-mean", repr(args.chat_input_mean), "--chat-output-mean", repr(args.chat_output_mean),
                 "--chat-sigma", repr(args.chat_sigma)]
    else:
        argv += ["--dataset", str(args.dataset)]
    return argv

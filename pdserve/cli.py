"""The `pdserve` command line: one subcommand per job, each a thin call into the package.

The serving commands (router, prefill, decode, colocated, cluster, generate) belong to their own
modules: their whole argument list is handed to that module's `main(argv)`, imported
only when the command runs, so `pdserve demo` never loads gRPC and a server's flags
are documented by `pdserve <command> --help`.

Every command ends the same way on Ctrl-C: exit status 130 and no traceback. The servers
stop themselves on it (SIGINT is their stop signal); for the rest — `pdserve demo`, the
benchmarks, any command still importing — the KeyboardInterrupt ends here.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pdserve.common.lifecycle import ExitStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.config import DTYPE_NAMES

DEMO_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Disaggregated serving splits prefill and decode because",
    "Bonjour, je m'appelle",
]


# command -> (module whose main(argv) runs it, or "module:kind" for a node kind's, one-line help)
DELEGATED_COMMANDS: dict[str, tuple[str, str]] = {
    "router": ("pdserve.router.fronts.entry", "run the router (public gRPC API, placement, registry)"),
    "prefill": ("pdserve.node_kinds:prefill", "run a prefill node"),
    "decode": ("pdserve.node_kinds:decode", "run a decode node (--local-prefill: a hybrid that also prefills)"),
    "colocated": ("pdserve.node_kinds:colocated", "run a colocated node (both phases; the baseline)"),
    "cluster": ("pdserve.cluster", "run a local cluster: router + N prefill + M decode (or N colocated) nodes"),
    "generate": ("pdserve.router.fronts.client", "stream a generation from a running cluster"),
    "sweep-models": ("pdserve.model_sweep", "every transformers causal-LM architecture, tiny: served exactly or refused"),
    "profile": ("pdserve.planner.profile_cli", "measure step times of node configurations on this machine (cached)"),
    "plan": ("pdserve.planner.cli", "from a workload and TTFT/TPOT SLOs to the best `pdserve cluster` command"),
}

# `pdserve bench NAME ...` -> (module whose main(argv) runs it, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "throughput": ("pdserve.bench.throughput", "offline throughput vs transformers generate / generate_batch"),
    "dtypes": ("pdserve.bench.dtypes", "one-stream decode and prefill in each dtype setup (auto, bf16, fp32)"),
    "disagg-latency": ("pdserve.bench.disagg_latency", "one request through 1P1D: TTFT vs KV transfer"),
    "overload": ("pdserve.bench.overload", "10x the cluster's capacity: rejections and admitted latency"),
    "serve": ("pdserve.bench.serve.cli", "open-loop load on a running cluster: SLO attainment, goodput sweep"),
    "serve-compare": ("pdserve.bench.serve_compare", "1P1D, colocated and hybrid on the same two cores: goodput per SLO"),
    "rebalance": ("pdserve.bench.rebalance", "a mix that shifts halfway, with and without the load mode"),
    "plan-validation": ("pdserve.bench.plan_validation", "pdserve plan --validate over 3 workloads x 2 SLO pairs"),
    "structured": ("pdserve.bench.structured", "engine tokens/s with none, one or all requests under a JSON schema"),
}


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:
        return ExitStatus.INTERRUPTED


def _main(argv: list[str]) -> int:
    # Before argparse: its REMAINDER cannot capture a rest that starts with an option.
    if argv and argv[0] in DELEGATED_COMMANDS:
        return _delegate(DELEGATED_COMMANDS[argv[0]][0], argv[1:])
    if len(argv) > 1 and argv[0] == "bench" and argv[1] in BENCHMARKS:
        return _delegate(BENCHMARKS[argv[1]][0], argv[2:])
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return ExitStatus.USAGE
    return args.run(args) or 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(title="commands")
    for name, (_, help_text) in DELEGATED_COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)  # listed here, run by _delegate
    make = sub.add_parser("make-model", help="write a randomly initialised model + tokenizer to DIR")
    make.add_argument("dir")
    make.add_argument("--arch", choices=["llama", "qwen2", "mistral", "qwen3"], default="llama")
    make.add_argument("--size", choices=["tiny", "small", "smol135m"], default="tiny")
    make.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(run=_make_model)

    demo = sub.add_parser("demo", help="offline generation on the built-in demo model")
    demo.add_argument("--model", help="model directory (default: the built-in demo model)")
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument("--dtype", choices=DTYPE_NAMES, default="auto")
    demo.add_argument("--temperature", type=float, default=0.0)
    demo.add_argument("prompts", nargs="*", default=DEMO_PROMPTS)
    demo.set_defaults(run=_demo)

    bench = sub.add_parser("bench", help="benchmarks (scripts that print ratios)")
    bench_sub = bench.add_subparsers(title="benchmarks")
    for name, (_, help_text) in BENCHMARKS.items():
        bench_sub.add_parser(name, help=help_text, add_help=False)  # listed here, run by _delegate
    return parser


def _delegate(target: str, rest: list[str]) -> int:
    module_name, _, kind = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:  # a missing dependency inside it: show the real error
            raise
        print(f"pdserve: {module_name} is not part of this installation", file=sys.stderr)
        return ExitStatus.USAGE
    if kind:  # a node kind's row (pdserve/node_kinds.py)
        return module.main(kind, rest) or 0
    return module.main(rest) or 0


def _make_model(args) -> int:
    import torch

    from pdserve.model_factory import make_model

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    path = make_model(args.dir, args.arch, args.size, dtype=dtype, seed=args.seed)
    print(f"wrote {args.arch}/{args.size} ({args.dtype}) to {path}")
    return 0


def _demo(args) -> int:
    from pdserve.model_factory import ensure_demo_model
    from pdserve.llm import LLM

    model = args.model or ensure_demo_model()
    llm = LLM(model, dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
    for event in llm.stream(args.prompts, params):
        if event.delta.text:
            print(f"[{event.prompt_index}] {event.delta.text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

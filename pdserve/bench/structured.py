"""Benchmark: what structured output costs the engine's throughput, as ratios to an unconstrained batch.

Run `pdserve bench structured [flags]` (or `python -m pdserve.bench.structured`). One seeded
workload of `--num-requests` random prompts, each generating up to `--max-tokens` tokens
(ignore_eos), goes through the engine (`add_request` + `step()` until done) three ways: none
constrained, one constrained among them, all constrained. A constrained request follows a JSON
schema compiled once before the timed rounds (the grammar cache then serves every request), so
what is timed is the per-step mask and matcher work. The modes are interleaved over `--rounds`
and each keeps its round of the most tokens per process-CPU second (wall time on a shared machine
swings 2x with the load; both are printed); output tokens are printed with the rates, since a
constrained request may end early when its grammar completes.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured_output import StructuredOutput
from pdserve.model_factory import ensure_demo_model

# Long strings and an unbounded array: a random model keeps writing inside the grammar.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
MODES = {"none": 0, "one": 1, "all": None}  # how many requests are constrained (None: every one)


@dataclass
class Round:
    output_tokens: int
    seconds: float  # wall
    cpu_seconds: float  # this process's, every thread: what contention on a shared machine inflates least

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.output_tokens / self.cpu_seconds


def run_round(engine, prompts: list[list[int]], max_tokens: int, num_constrained: int, tag: str) -> Round:
    free = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                 structured_output=StructuredOutput.json_schema(SCHEMA))
    start, cpu_start = time.perf_counter(), time.process_time()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, constrained if i < num_constrained else free)
    tokens = 0
    while engine.has_unfinished():
        tokens += len(engine.step())
    return Round(tokens, time.perf_counter() - start, time.process_time() - cpu_start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench structured", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="model directory (default: the demo model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    from pdserve.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model_dir or str(ensure_demo_model())
    llm = LLM(model, dtype=args.dtype, max_num_seqs=max(64, args.num_requests))
    engine = llm.engine
    rng = random.Random(0)
    vocab = min(len(engine.loaded.tokenizer), engine.loaded.vocab_size)
    prompts = [[rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    run_round(engine, prompts[:2], 4, 2, "warmup")  # compiles the grammar, warms the step
    best: dict[str, Round] = {}
    for r in range(args.rounds):
        for mode, count in MODES.items():
            result = run_round(engine, prompts, args.max_tokens, args.num_requests if count is None else count,
                               f"{mode}-{r}")
            if mode not in best or result.tokens_per_cpu_s > best[mode].tokens_per_cpu_s:
                best[mode] = result
    print(f"model {model}, {args.num_requests} requests x up to {args.max_tokens} tokens, best of {args.rounds}")
    base = best["none"]
    for mode, result in best.items():
        print(f"{mode:>5} constrained: {result.output_tokens:>5} tokens, {result.cpu_seconds:6.2f} CPU s = "
              f"{result.tokens_per_cpu_s:8.1f} tok/CPU-s ({result.tokens_per_cpu_s / base.tokens_per_cpu_s:.3f}x none);"
              f" wall {result.seconds:6.2f} s = {result.tokens_per_s:8.1f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

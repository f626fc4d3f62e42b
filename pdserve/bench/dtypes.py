"""`pdserve bench dtypes`: one-stream decode and 512-token prefill of the engine in each dtype setup.

One run, the setups interleaved round by round (medians of `--rounds`), on the same smol135m-shaped
model saved twice (a bf16 and a float32 checkpoint):
  - what `--dtype auto` picks on this machine;
  - bfloat16 compute (native bf16 CPUs: AMX, AVX512_BF16);
  - float32 compute on the bf16 checkpoint: bf16-stored matrices, what `auto` runs on a CPU
    without native bf16 (same values, half the bytes per decode step);
  - float32 compute on the float32 checkpoint, native forward (token-exact mode);
  - the same on the transformers implementation: the ratios' baseline.
It prints the CPU capability and the choice `auto` made, and ratios against the baseline.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from dataclasses import dataclass

import torch

from pdserve.bench.common import OneStreamEngine, ensure_model
from pdserve.engine.dtype_choice import auto_dtype

PREFILL_TOKENS = 512
BASELINE = "float32, float32 checkpoint, transformers"


@dataclass(frozen=True)
class Setup:
    name: str
    checkpoint: str  # "bfloat16" or "float32": which saved copy of the model
    dtype: str
    model_impl: str = "auto"


def setups(auto: str) -> list[Setup]:
    return [
        Setup(f"auto (= {auto}), bf16 checkpoint", "bfloat16", "auto"),
        Setup("bfloat16, bf16 checkpoint", "bfloat16", "bfloat16"),
        Setup("float32, bf16 checkpoint (bf16-stored matrices)", "bfloat16", "float32"),
        Setup("float32, float32 checkpoint", "float32", "float32"),
        Setup(BASELINE, "float32", "float32", "transformers"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench dtypes", description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    choice = auto_dtype()
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}; auto -> {choice.dtype} ({choice.reason})")
    runners = {
        s.name: OneStreamEngine(ensure_model("llama", "smol135m", s.checkpoint), PREFILL_TOKENS, dtype=s.dtype,
                                model_impl=s.model_impl, num_threads=args.threads)
        for s in setups(choice.dtype)
    }  # fmt: skip
    prompt = [random.Random(0).randrange(1, 40000) for _ in range(PREFILL_TOKENS)]
    decode: dict[str, list[float]] = {name: [] for name in runners}
    prefill: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, runner in runners.items():
            decode[name].append(runner.decode(prompt[:1], args.decode_tokens))
            prefill[name].append(runner.prefill(prompt))
    base_decode, base_prefill = statistics.median(decode[BASELINE]), statistics.median(prefill[BASELINE])
    print(f"\n{'setup':<52} {'decode tok/s':>12} {'ratio':>6} {'prefill tok/s':>14} {'ratio':>6}")
    for name in runners:
        d, p = statistics.median(decode[name]), statistics.median(prefill[name])
        print(f"{name:<52} {d:>12.1f} {d / base_decode:>5.2f}x {p:>14.1f} {p / base_prefill:>5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

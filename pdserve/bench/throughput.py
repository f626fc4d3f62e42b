"""Benchmark: offline output-token throughput of the engine against transformers, in one run.

Run `pdserve bench throughput [flags]` (or `python -m pdserve.bench.throughput`). One
seeded workload (random prompt ids, every request generating exactly `--max-tokens`
tokens) goes through, in order:
  1. the engine, driven step by step (`add_request` + `step()` until done), timing
     every step and classifying a step as pure decode when nothing waits and every
     running request has exactly one token left to compute;
  2. transformers `generate` on static left-padded batches (stock sdpa attention);
  3. transformers `generate_batch` (its continuous batching), on the same token budget;
  4. the floor: weight bytes ÷ the copy bandwidth measured in the same process.
With `--tp T` (T > 1) the engine phase runs again on T tensor-parallel ranks right after
step 1, with the same total torch threads, and reports TP=T over TP=1 next to what the
ranks cost per step: the batch hand-off, the all-reduces, and a gloo broadcast of the same
batches and the same all-reduces with no rank computing, for comparison (pdserve/bench/tp_costs.py).
Each system gets an untimed warm-up first. The machine is shared and noisy, so only
ratios taken in the same run mean anything; absolute numbers are printed for context,
next to each phase's process CPU seconds and the 1-minute load average after it, which
show a phase that ran while something else loaded the machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.bench.common import Stopwatch, capture_logger, chunks, copy_bandwidth, ensure_model
from pdserve.bench.common import left_pad, weight_bytes
from pdserve.bench.tp_costs import (StepCosts, cost_report, gloo_replay_cost, measured_step_costs, print_tp_report,
                                    restored_affinity, threads_per_rank, tp_ratios)
from pdserve.engine.config import DTYPE_NAMES
from pdserve.engine.dtype_choice import resolve_dtype

DEFAULT_OUT = "results/throughput.json"
WARMUP_PROMPT_LEN = 16
WARMUP_MAX_TOKENS = 4
# transformers' continuous batching logs (and swallows) its failures through this logger.
CB_LOGGER = "ContinuousBatchingLogger"


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: int


@dataclass
class SystemResult:
    name: str
    output_tokens: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # process CPU time, all threads
    output_lens: list[int] = field(default_factory=list)  # per request, in prompt order
    extra: dict = field(default_factory=dict)
    error: str | None = None  # why the system could not run; the numbers above are then zero

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_cpu_s(self) -> float:
        """Less sensitive than tokens_per_s to other processes taking the cores during this phase."""
        return self.output_tokens / self.cpu_seconds if self.cpu_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "output_tokens": self.output_tokens,
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_cpu_s": self.tokens_per_cpu_s,
            "output_lens": self.output_lens,
            "error": self.error,
            **self.extra,
        }


def make_workload(vocab_size: int, args: argparse.Namespace) -> Workload:
    """Prompt lengths uniform in [min_prompt, max_prompt]; ids uniform in [1, vocab), never special token 0."""
    rng = random.Random(args.seed)
    lens = [rng.randint(args.min_prompt, args.max_prompt) for _ in range(args.num_requests)]
    prompts = [[rng.randrange(1, vocab_size) for _ in range(n)] for n in lens]
    return Workload(prompts, args.max_tokens)


def _warmup_workload(vocab_size: int, seed: int) -> Workload:
    rng = random.Random(seed + 1)
    prompts = [[rng.randrange(1, vocab_size) for _ in range(WARMUP_PROMPT_LEN)] for _ in range(2)]
    return Workload(prompts, WARMUP_MAX_TOKENS)


# --------------------------------------------------------------------------- engine


def run_engine(model_dir: Path, workload: Workload, vocab_size: int, args: argparse.Namespace) -> SystemResult:
    from pdserve import SamplingParams
    from pdserve.engine.model_runner import kv_block_bytes

    engine = _make_llm(model_dir, args).engine
    _warm_up(engine, vocab_size, args.seed)
    params = SamplingParams(temperature=0, max_tokens=workload.max_tokens, ignore_eos=True)
    result = _drive_engine(engine, workload, params, "bench")
    result.extra.update(
        method="engine-step loop (add_request + step until done)",
        weight_bytes=weight_bytes(engine.loaded.model),
        kv_bytes_per_token=kv_block_bytes(engine.loaded, 1, engine.config.torch_dtype),
        num_preemptions=engine.scheduler.num_preemptions,
    )
    return result


def run_engine_tp(model_dir: Path, workload: Workload, vocab_size: int,
                  args: argparse.Namespace) -> tuple[SystemResult, StepCosts]:
    """The engine phase on `args.tp` ranks, its hand-offs and all-reduces timed in the measured
    part only. The ranks are stopped, and this process unpinned, before it returns."""
    from pdserve import SamplingParams

    with restored_affinity(), _make_llm(model_dir, args, args.tp) as llm:
        engine = llm.engine
        _warm_up(engine, vocab_size, args.seed)
        params = SamplingParams(temperature=0, max_tokens=workload.max_tokens, ignore_eos=True)
        with measured_step_costs(engine.runner) as costs:
            result = _drive_engine(engine, workload, params, "bench-tp")
    result.name = f"pdserve engine, TP={args.tp}"
    result.extra.update(
        method="engine-step loop (add_request + step until done), rank 0 of a tensor-parallel group",
        tensor_parallel_size=args.tp,
        threads_per_rank=threads_per_rank(args.threads, args.tp),
    )
    return result, costs


def _make_llm(model_dir: Path, args: argparse.Namespace, tp: int = 1):
    """The engine on `tp` ranks sharing `--threads` (one rank: all of them)."""
    from pdserve import LLM

    return LLM(
        model_dir,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=threads_per_rank(args.threads, tp),
        tensor_parallel_size=tp,
    )


def _warm_up(engine, vocab_size: int, seed: int) -> None:
    from pdserve import SamplingParams

    warm = _warmup_workload(vocab_size, seed)
    _drive_engine(engine, warm, SamplingParams(temperature=0, max_tokens=warm.max_tokens, ignore_eos=True), "warmup")


def _drive_engine(engine, workload: Workload, params, prefix: str) -> SystemResult:
    req_ids = [f"{prefix}-{i}" for i in range(len(workload.prompts))]
    counts = dict.fromkeys(req_ids, 0)
    for req_id, prompt in zip(req_ids, workload.prompts):
        engine.add_request(req_id, prompt, params)
    num_steps, step_seconds, decode_times, decode_batches, decode_kv_tokens = 0, 0.0, [], [], []
    with Stopwatch() as watch:
        while engine.has_unfinished():
            decode = _pure_decode_batch(engine.scheduler)
            step_start = time.perf_counter()
            outputs = engine.step()
            step_time = time.perf_counter() - step_start
            num_steps += 1
            step_seconds += step_time
            for out in outputs:
                counts[out.req_id] += 1
            if decode is not None:
                decode_times.append(step_time)
                decode_batches.append(decode[0])
                decode_kv_tokens.append(decode[1])
    lens = [counts[r] for r in req_ids]
    return SystemResult(
        "pdserve engine",
        sum(lens),
        watch.wall_s,
        watch.cpu_s,
        lens,
        {
            **watch.to_dict(),
            "num_steps": num_steps,
            "step_mean_s": step_seconds / num_steps if num_steps else 0.0,
            "num_decode_steps": len(decode_times),
            "decode_step_mean_s": _mean(decode_times),
            "decode_batch_mean": _mean(decode_batches),
            "decode_kv_tokens_mean": _mean(decode_kv_tokens),
        },
    )


def _pure_decode_batch(scheduler) -> tuple[int, int] | None:
    """(batch size, KV tokens read) if the next step decodes one token per running request, else None."""
    if scheduler.waiting or not scheduler.running:
        return None
    if any(r.num_tokens - r.num_computed_tokens != 1 for r in scheduler.running):
        return None
    return len(scheduler.running), sum(r.num_tokens for r in scheduler.running)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


# ------------------------------------------------------------------ tensor parallel


def run_tensor_parallel(model_dir: Path, workload: Workload, vocab_size: int, engine: SystemResult,
                        args: argparse.Namespace) -> tuple[SystemResult, dict]:
    """TP=`args.tp` against the TP=1 `engine` result of this run, and what the ranks cost per step."""
    result, costs = run_engine_tp(model_dir, workload, vocab_size, args)
    print(f"engine, TP={args.tp}: {result.tokens_per_s:.1f} tok/s", flush=True)
    gc.collect()
    try:
        replay = gloo_replay_cost(costs.step_words, costs.reduce_sizes, costs.reduce_dtype, args.tp)
    except Exception as exc:  # report, don't crash: the TP measurements stand
        print(f"gloo replay failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        replay = None
    base, tp = engine.to_dict(), result.to_dict()
    report = {
        "size": args.tp,
        "threads_per_rank": threads_per_rank(args.threads, args.tp),
        "engine": tp,
        "costs": cost_report(costs, result.extra["num_steps"], replay),
        "ratios": tp_ratios(base, tp),
    }
    return result, report


def _check_tensor_parallel(model_dir: Path, size: int) -> str | None:
    """Why `--tp` cannot split this model, before any phase runs; None when it can."""
    from pdserve.engine.model_folder import ModelRefused
    from pdserve.engine.model_loader import check_tensor_parallel

    try:
        check_tensor_parallel(model_dir, "auto", size)
    except ModelRefused as exc:
        return f"--tp {size}: {exc.reason} (pass --model-dir of a model whose shapes split)"
    return None


# ---------------------------------------------------------------------- transformers


def run_hf_generate(
    model_dir: Path, workload: Workload, vocab_size: int, pad_id: int, args: argparse.Namespace
) -> SystemResult:
    from transformers import GenerationConfig

    from pdserve.engine.model_loader import load_reference_model

    model = load_reference_model(model_dir, getattr(torch, args.dtype))

    def generate(w: Workload) -> list[int]:
        # min_new_tokens keeps eos out of the first max_tokens steps: no row stops early.
        config = GenerationConfig(
            max_new_tokens=w.max_tokens, min_new_tokens=w.max_tokens, do_sample=False, pad_token_id=pad_id
        )
        lens = []
        for batch in chunks(w.prompts, args.batch_size):
            input_ids, mask = left_pad(batch, pad_id)
            with torch.inference_mode():
                out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
            lens += [out.shape[1] - input_ids.shape[1]] * len(batch)
        return lens

    generate(_warmup_workload(vocab_size, args.seed))
    with Stopwatch() as watch:
        lens = generate(workload)
    return SystemResult(
        f"transformers generate (static batches of {args.batch_size})",
        sum(lens),
        watch.wall_s,
        watch.cpu_s,
        lens,
        {**watch.to_dict(), "batch_size": args.batch_size, "attention": model.config._attn_implementation},
    )


def run_hf_generate_batch(
    model_dir: Path, workload: Workload, vocab_size: int, pad_id: int, args: argparse.Namespace
) -> SystemResult:
    """transformers' continuous batching, with the engine's token budget and batch size.

    generate_batch logs its failures and returns whatever finished, so failures are
    found by counting outputs; the captured log lines explain them.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from pdserve.engine.model_loader import load_reference_model

    name = "transformers generate_batch (continuous batching)"
    model = load_reference_model(model_dir, getattr(torch, args.dtype))
    longest = max(len(p) for p in workload.prompts) + workload.max_tokens
    page_size = 256
    # Sized to hold every request at once, as the engine's KV cache is; sizing from
    # free memory would allocate (and mask over) a cache as large as the machine.
    cb_config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=len(workload.prompts) * -(-longest // page_size),
        max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs,
    )
    keys = ("page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch")
    settings = {k: getattr(cb_config, k) for k in keys}

    def generate(w: Workload, persistent: bool) -> list[int]:
        # eos_token_id=None: generate_batch replaces it by -1, i.e. no eos at all.
        config = GenerationConfig(
            max_new_tokens=w.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad_id
        )
        outputs = model.generate_batch(
            inputs=w.prompts, generation_config=config, continuous_batching_config=cb_config,
            persistent_manager=persistent,
        )
        results = list(outputs.values())
        if len(results) != len(w.prompts) or any(r.error is not None for r in results):
            errors = [r.error for r in results if r.error is not None]
            raise RuntimeError(f"{len(results)}/{len(w.prompts)} requests returned; errors: {errors[:3]}")
        return [len(r.generated_tokens) for r in results]

    with capture_logger(CB_LOGGER) as log:
        try:
            # The warm-up keeps its manager, so the timed run does not pay for building one.
            generate(_warmup_workload(vocab_size, args.seed), persistent=True)
            with Stopwatch() as watch:
                lens = generate(workload, persistent=False)
        except Exception as exc:  # report, don't crash: the other measurements stand
            return SystemResult(name, extra={"log": log, **settings}, error=f"{type(exc).__name__}: {exc}")
        finally:
            model.destroy_cached_continuous_batching_manager()
    return SystemResult(name, sum(lens), watch.wall_s, watch.cpu_s, lens, {**watch.to_dict(), "log": log, **settings})


# --------------------------------------------------------------------------- report


def floor_report(engine: SystemResult, bandwidth: float) -> dict:
    """The memory-bound floor of one decode step: read every weight once (and, second figure, the KV too)."""
    weights = engine.extra["weight_bytes"]
    kv = engine.extra["decode_kv_tokens_mean"] * engine.extra["kv_bytes_per_token"]
    return {
        "weight_bytes": weights,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "bandwidth_convention": "bytes read + written by one large tensor copy (STREAM copy), best of rounds",
        "floor_s": weights / bandwidth,
        "floor_with_kv_s": (weights + kv) / bandwidth,
    }


def ratios(engine: SystemResult, generate: SystemResult | None, batch: SystemResult | None, floor: dict) -> dict:
    def over(other: SystemResult | None, per_cpu: bool = False) -> float | None:
        if other is None:
            return None
        if per_cpu:
            return engine.tokens_per_cpu_s / other.tokens_per_cpu_s if other.tokens_per_cpu_s > 0 else None
        return engine.tokens_per_s / other.tokens_per_s if other.tokens_per_s > 0 else None

    step = engine.extra["decode_step_mean_s"]
    return {
        "engine_over_generate": over(generate),
        "engine_over_generate_batch": over(batch),
        "engine_over_generate_per_cpu_s": over(generate, per_cpu=True),
        "engine_over_generate_batch_per_cpu_s": over(batch, per_cpu=True),
        "decode_step_over_floor": step / floor["floor_s"] if step > 0 else None,
        "decode_step_over_floor_with_kv": step / floor["floor_with_kv_s"] if step > 0 else None,
    }


def print_report(results: list[SystemResult], floor: dict, engine: SystemResult, rat: dict) -> None:
    print(f"\n{'system':<52} {'out tokens':>10} {'seconds':>9} {'cpu s':>9} {'load':>5} {'tok/s':>9}")
    for r in results:
        if r.error is not None:
            print(f"{r.name:<52} error: {r.error}")
            continue
        load = r.extra["loadavg_1min_after"]
        print(
            f"{r.name:<52} {r.output_tokens:>10} {r.seconds:>9.2f} {r.cpu_seconds:>9.2f} {load:>5.1f} "
            f"{r.tokens_per_s:>9.1f}"
        )
    print(
        f"\ndecode step: mean {engine.extra['decode_step_mean_s'] * 1e3:.2f} ms over "
        f"{engine.extra['num_decode_steps']} pure-decode steps (mean batch {engine.extra['decode_batch_mean']:.1f})"
    )
    print(
        f"floor: {floor['weight_bytes'] / 2**20:.0f} MiB weights / "
        f"{floor['copy_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s copy = {floor['floor_s'] * 1e3:.2f} ms "
        f"(with the KV read: {floor['floor_with_kv_s'] * 1e3:.2f} ms)"
    )
    print("\nratios (same run):")
    for key, value in rat.items():
        print(f"  {key:<38} {'n/a' if value is None else f'{value:.2f}x'}")


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir) if args.model_dir else ensure_model("llama", "smol135m", "bfloat16")
    refused = _check_tensor_parallel(model_dir, args.tp) if args.tp > 1 else None
    if refused is not None:
        print(refused, file=sys.stderr)
        return 2
    vocab_size, pad_id = _tokenizer_facts(model_dir)
    workload = make_workload(vocab_size, args)
    print(
        f"model {model_dir} ({args.dtype}), {len(workload.prompts)} requests × {workload.max_tokens} tokens, "
        f"prompts {args.min_prompt}-{args.max_prompt} (total {sum(map(len, workload.prompts))}), "
        f"{args.threads} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}"
        + (f", TP=1 then TP={args.tp} ({threads_per_rank(args.threads, args.tp)} threads per rank)"
           if args.tp > 1 else ""),
        flush=True,
    )
    engine = run_engine(model_dir, workload, vocab_size, args)
    print(f"engine: {engine.tokens_per_s:.1f} tok/s", flush=True)
    gc.collect()
    tp_result = tp_report = None
    if args.tp > 1:
        tp_result, tp_report = run_tensor_parallel(model_dir, workload, vocab_size, engine, args)
        gc.collect()
    floor = floor_report(engine, copy_bandwidth(args.copy_mib << 20))
    generate = batch = None
    if not args.skip_hf:
        generate = run_hf_generate(model_dir, workload, vocab_size, pad_id, args)
        print(f"transformers generate: {generate.tokens_per_s:.1f} tok/s", flush=True)
        gc.collect()
    if not args.skip_hf and not args.skip_generate_batch:
        batch = run_hf_generate_batch(model_dir, workload, vocab_size, pad_id, args)
        gc.collect()
    results = [r for r in (engine, tp_result, generate, batch) if r is not None]
    rat = ratios(engine, generate, batch, floor)
    print_report(results, floor, engine, rat)
    if tp_report is not None:
        print_tp_report(engine.to_dict(), tp_report["engine"], args.tp, tp_report["costs"], tp_report["ratios"])
    anchors = None
    if args.anchors:
        from pdserve.bench.anchors import run_anchors

        gc.collect()
        anchors = run_anchors(model_dir, args.dtype, engine, workload, args)
    _write_json(args, model_dir, workload, engine, generate, batch, floor, rat, anchors, tp_report)
    return _check_lengths(results, workload.max_tokens)


def _tokenizer_facts(model_dir: Path) -> tuple[int, int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return len(tokenizer), tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def _check_lengths(results: list[SystemResult], max_tokens: int) -> int:
    """Exit status: 1 if a system that ran produced other than max_tokens for some request."""
    status = 0
    for r in results:
        if r.error is not None:
            continue
        wrong = sum(1 for n in r.output_lens if n != max_tokens)
        if wrong:
            print(f"WARNING: {r.name}: {wrong} requests did not produce exactly {max_tokens} tokens", file=sys.stderr)
            status = 1
    return status


def _write_json(args, model_dir, workload, engine, generate, batch, floor, rat, anchors, tp_report) -> None:
    import transformers

    data = {
        "args": vars(args),
        "model_dir": str(model_dir),
        "machine": {
            "cpu_count": os.cpu_count(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "transformers": transformers.__version__,
        },
        "workload": {
            "num_requests": len(workload.prompts),
            "max_tokens": workload.max_tokens,
            "prompt_lens": [len(p) for p in workload.prompts],
            "total_prompt_tokens": sum(len(p) for p in workload.prompts),
        },
        "engine": engine.to_dict(),
        "hf_generate": generate.to_dict() if generate else None,
        "hf_generate_batch": batch.to_dict() if batch else None,
        "floor": floor,
        "ratios": rat,
        "anchors": anchors,
        "tensor_parallel": tp_report,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"\nwrote {out}")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve bench throughput", description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", help="model directory (default: smol135m bf16, built once in the pdserve cache)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="auto", help="auto: the machine's native fast dtype")
    parser.add_argument("--num-requests", type=_positive_int, default=64)
    parser.add_argument("--max-tokens", type=_positive_int, default=128)
    parser.add_argument("--min-prompt", type=_positive_int, default=64)
    parser.add_argument("--max-prompt", type=_positive_int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=_positive_int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=_positive_int, default=512)
    parser.add_argument("--batch-size", type=_positive_int, default=16, help="static batch size of transformers generate")
    parser.add_argument("--skip-hf", action="store_true", help="skip both transformers measurements")
    parser.add_argument("--skip-generate-batch", action="store_true")
    parser.add_argument("--threads", type=_positive_int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=_positive_int, default=1,
                        help="also run the engine on this many tensor-parallel ranks (sharing --threads) "
                             "and report TP=N over TP=1 with the per-step cost of the ranks")
    parser.add_argument("--copy-mib", type=_positive_int, default=512, help="size of the bandwidth-measuring copy")
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--anchors", action="store_true",
                        help="also run llama.cpp and CTranslate2 (built/installed once into the cache) and report ratios")
    parser.add_argument("--anchor-rounds", type=_positive_int, default=3, help="interleaved rounds of the one-stream phases")
    args = parser.parse_args(argv)
    args.dtype = resolve_dtype(args.dtype)
    if args.max_prompt < args.min_prompt:
        parser.error("--max-prompt must be >= --min-prompt")
    return args


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())

"""`pdserve bench throughput --anchors`: the engine against llama.cpp, CTranslate2 and transformers.

One run, on the same weights, the systems interleaved round by round (medians of `--anchor-rounds`):
  - one stream: decode tok/s (128 tokens after a 1-token prompt; llama-bench tg128) and the
    prefill of a 512-token prompt (llama-bench pp512, transformers' forward); the engine runs
    these in a fresh process each round, as llama-bench does;
  - offline: the bench's request workload (64 by default) on CTranslate2 and on
    llama-batched-bench with as many parallel sequences, next to the engine's own run;
  - floors: weight bytes ÷ read bandwidth (one stream), and for the batch-64 decode step the
    larger of the compute floor (FLOPs ÷ this run's GEMM rate) and the weight + KV read floor;
  - the engine's peak RSS (a child process) against weights + KV cache + 300 MB.
It prints the CPU capability, each figure, each ratio and the target it answers to.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.bench import anchor_tools
from pdserve.bench.common import OneStreamEngine, read_bandwidth

ONE_STREAM_TOKENS = 128
PREFILL_TOKENS = 512
RSS_SLACK_BYTES = 300 << 20


@dataclass
class Figures:
    """tok/s per system and phase: {"decode": {...}, "prefill": {...}, "offline": {...}}."""

    rounds: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def add(self, phase: str, system: str, value: float) -> None:
        self.rounds.setdefault(phase, {}).setdefault(system, []).append(value)

    def median(self, phase: str, system: str) -> float | None:
        values = self.rounds.get(phase, {}).get(system)
        return statistics.median(values) if values else None


def run_anchors(model_dir: Path, dtype: str, engine_offline, workload, args) -> dict:
    """Every anchor phase; engine_offline is the bench's engine result on the same workload."""
    figures = Figures()
    capability = torch.backends.cpu.get_cpu_capability()
    llama = anchor_tools.ensure_llama_cpp()
    ggufs = {t: anchor_tools.ensure_gguf(llama, model_dir, t) for t in ("bf16", "q8_0")}
    ct2_dir = anchor_tools.ensure_ctranslate2(model_dir)
    vocab = _vocab_size(model_dir)
    reference = _TransformersForward(model_dir, dtype)
    prompt = _random_ids(vocab, PREFILL_TOKENS, args.seed)
    for round_index in range(args.anchor_rounds):
        print(f"anchors: round {round_index + 1}/{args.anchor_rounds}", flush=True)
        decode, prefill = engine_one_stream(model_dir, dtype, args.threads, prompt)
        figures.add("decode", "pdserve", decode)
        figures.add("prefill", "pdserve", prefill)
        figures.add("prefill", "transformers forward", reference.prefill(prompt))
        for outtype, gguf in ggufs.items():
            result = anchor_tools.run_llama_bench(llama, gguf, args.threads, PREFILL_TOKENS, ONE_STREAM_TOKENS, 1)
            figures.add("decode", f"llama.cpp {outtype}", result.decode_tokens_per_s)
            figures.add("prefill", f"llama.cpp {outtype}", result.prompt_tokens_per_s)
        # CTranslate2's worker threads outlive its calls and would take the cores from the
        # others: each of its phases gets its own generator, closed before the next phase.
        with _CTranslate2(ct2_dir, args.threads) as ct2:
            figures.add("decode", "CTranslate2 float32", ct2.decode(prompt[:1], ONE_STREAM_TOKENS))
    figures.add("offline", "pdserve", engine_offline.tokens_per_s)
    with _CTranslate2(ct2_dir, args.threads) as ct2:
        figures.add("offline", "CTranslate2 float32", ct2.offline(workload))
    mean_prompt = round(statistics.mean(len(p) for p in workload.prompts))
    batched = anchor_tools.run_batched_bench(llama, ggufs["bf16"], args.threads, mean_prompt, workload.max_tokens,
                                             len(workload.prompts))  # fmt: skip
    figures.add("offline", "llama-batched-bench bf16", batched.output_tokens_per_s)
    figures.notes["llama-batched-bench"] = f"{batched.parallel} sequences, {mean_prompt}-token prompts (the mean)"
    floors = _floors(engine_offline, dtype, args)
    rss = engine_peak_rss(model_dir, dtype, args.threads)
    report = _report(figures, floors, rss, capability, dtype)
    print_anchor_report(report)
    return report


class _TransformersForward:
    def __init__(self, model_dir: Path, dtype: str) -> None:
        from pdserve.engine.model_loader import load_reference_model

        self.model = load_reference_model(model_dir, dtype)

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> float:
        ids = torch.tensor([prompt])
        start = time.perf_counter()
        self.model(ids, logits_to_keep=1)
        return len(prompt) / (time.perf_counter() - start)


class _CTranslate2:
    def __init__(self, model_dir: Path, threads: int) -> None:
        import ctranslate2

        self.generator = ctranslate2.Generator(str(model_dir), device="cpu", compute_type="float32",
                                               intra_threads=threads)  # fmt: skip
        self.tokens = _ct2_vocabulary(model_dir)
        self.decode(_random_ids(100, 16, 0), 4)  # warm-up

    def __enter__(self) -> _CTranslate2:
        return self

    def __exit__(self, *exc) -> None:
        del self.generator
        gc.collect()

    def decode(self, prompt: list[int], tokens: int) -> float:
        start_tokens = [[self.tokens[i] for i in prompt]]
        stamps = []

        def on_step(step) -> bool:
            stamps.append(time.perf_counter())
            return False

        self.generator.generate_batch(start_tokens, max_length=tokens, min_length=tokens,
                                      include_prompt_in_result=False, callback=on_step)  # fmt: skip
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    def offline(self, workload) -> float:
        start_tokens = [[self.tokens[i] for i in p] for p in workload.prompts]
        start = time.perf_counter()
        results = self.generator.generate_batch(start_tokens, max_length=workload.max_tokens,
                                                min_length=workload.max_tokens, include_prompt_in_result=False,
                                                max_batch_size=len(start_tokens))  # fmt: skip
        seconds = time.perf_counter() - start
        return sum(len(r.sequences_ids[0]) for r in results) / seconds


def engine_one_stream(model_dir: Path, dtype: str, threads: int, prompt: list[int]) -> tuple[float, float]:
    """One-stream decode and prefill tok/s of a fresh engine process, as llama-bench runs in its
    own: this process also holds transformers' model and the offline phase's leftovers."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_one_stream_child, (str(model_dir), dtype, threads, prompt))


def _one_stream_child(model_dir: str, dtype: str, threads: int, prompt: list[int]) -> tuple[float, float]:
    engine = OneStreamEngine(Path(model_dir), PREFILL_TOKENS, dtype=dtype, num_threads=threads)
    return engine.decode(prompt[:1], ONE_STREAM_TOKENS), engine.prefill(prompt)


def engine_peak_rss(model_dir: Path, dtype: str, threads: int) -> dict:
    """Peak RSS of a fresh process that loads the engine and serves 64 requests, against its budget."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_measure_rss, (str(model_dir), dtype, threads))


def _measure_rss(model_dir: str, dtype: str, threads: int) -> dict:
    from pdserve import LLM, SamplingParams
    from pdserve.bench.common import weight_bytes

    llm = LLM(model_dir, dtype=dtype, num_threads=threads)
    prompts = [_random_ids(1000, n, i) for i, n in enumerate(random.Random(0).choices(range(64, 513), k=64))]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    engine = llm.engine
    kv_bytes = sum(c.numel() * c.element_size() for c in engine.runner.k_caches + engine.runner.v_caches)
    weights = weight_bytes(engine.loaded.model)
    peak = _peak_rss_bytes()
    return {"peak_rss_bytes": peak, "weight_bytes": weights, "kv_cache_bytes": kv_bytes,
            "budget_bytes": weights + kv_bytes + RSS_SLACK_BYTES}  # fmt: skip


def _peak_rss_bytes() -> int:
    """This process's own high-water mark (VmHWM). Not getrusage's ru_maxrss: Linux keeps that
    across execve, so a spawned child would report its (large) parent's peak."""
    with open("/proc/self/status") as status:
        line = next(ln for ln in status if ln.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _floors(engine_offline, dtype: str, args) -> dict:
    weights = engine_offline.extra["weight_bytes"]
    kv = engine_offline.extra["decode_kv_tokens_mean"] * engine_offline.extra["kv_bytes_per_token"]
    batch = engine_offline.extra["decode_batch_mean"]
    bandwidth = read_bandwidth(args.copy_mib << 20)
    flops = 2 * (weights / torch.tensor([], dtype=getattr(torch, dtype)).element_size()) * batch
    rate = gemm_rate(dtype, args.threads)
    return {
        "read_bandwidth_bytes_per_s": bandwidth,
        "one_stream_floor_tok_s": bandwidth / weights,
        "gemm_flop_per_s": rate,
        "batch_decode_step_s": engine_offline.extra["decode_step_mean_s"],
        "batch_decode_mean_batch": batch,
        "batch_compute_floor_s": flops / rate,
        "batch_read_floor_s": (weights + kv) / bandwidth,
    }


def gemm_rate(dtype: str, threads: int, size: int = 1024) -> float:
    """Best FLOP/s of a square matmul in `dtype`: this machine's compute ceiling for the floors."""
    torch.set_num_threads(threads)
    a = torch.randn(size, size).to(getattr(torch, dtype))
    b = torch.randn(size, size).to(getattr(torch, dtype))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def _report(figures: Figures, floors: dict, rss: dict, capability: str, dtype: str) -> dict:
    med = figures.median
    ours = {phase: med(phase, "pdserve") for phase in ("decode", "prefill", "offline")}

    def ratio(phase: str, other: str) -> float | None:
        theirs = med(phase, other)
        return ours[phase] / theirs if ours[phase] and theirs else None

    step_floor = max(floors["batch_compute_floor_s"], floors["batch_read_floor_s"])
    targets = [
        ("one stream decode / llama.cpp bf16 tg128", ratio("decode", "llama.cpp bf16"), 1.0),
        ("one stream decode / weight-read floor", ours["decode"] / floors["one_stream_floor_tok_s"], 0.7),
        ("offline / CTranslate2 float32", ratio("offline", "CTranslate2 float32"), 1.5),
        ("offline / llama-batched-bench bf16", ratio("offline", "llama-batched-bench bf16"), 1.0),
        ("prefill 512 / transformers forward", ratio("prefill", "transformers forward"), 1.0),
        ("prefill 512 / llama.cpp bf16 pp512", ratio("prefill", "llama.cpp bf16"), 1.0),
        ("floor / batch decode step (<= 2x floor)", step_floor / floors["batch_decode_step_s"], 0.5),
        ("RSS budget / peak RSS", rss["budget_bytes"] / rss["peak_rss_bytes"], 1.0),
    ]
    return {
        "cpu_capability": capability,
        "dtype": dtype,
        "medians_tok_s": {
            phase: {system: statistics.median(v) for system, v in systems.items()}
            for phase, systems in figures.rounds.items()
        },
        "rounds_tok_s": figures.rounds,
        "notes": figures.notes,
        "floors": floors,
        "rss": rss,
        "targets": [{"what": w, "ratio": r, "target": t, "met": r is not None and r >= t} for w, r, t in targets],
    }


def print_anchor_report(report: dict) -> None:
    print(f"\nanchors on CPU capability {report['cpu_capability']}, engine dtype {report['dtype']}")
    for phase, systems in report["medians_tok_s"].items():
        print(f"  {phase}:")
        for system, value in sorted(systems.items(), key=lambda kv: -kv[1]):
            print(f"    {system:<32} {value:>9.1f} tok/s")
    f = report["floors"]
    print(f"  read bandwidth {f['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s -> one-stream floor "
          f"{f['one_stream_floor_tok_s']:.1f} tok/s; GEMM {f['gemm_flop_per_s'] / 1e9:.0f} GFLOP/s")  # fmt: skip
    print(f"  batch decode step {f['batch_decode_step_s'] * 1e3:.1f} ms "
          f"(mean batch {f['batch_decode_mean_batch']:.1f}); "
          f"compute floor {f['batch_compute_floor_s'] * 1e3:.1f} ms, read floor {f['batch_read_floor_s'] * 1e3:.1f} ms")
    r = report["rss"]
    print(f"  peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB; weights {r['weight_bytes'] / 2**20:.0f} MiB + KV "
          f"{r['kv_cache_bytes'] / 2**20:.0f} MiB + 300 MiB = {r['budget_bytes'] / 2**20:.0f} MiB")
    print("  ratios (same run) against targets:")
    for t in report["targets"]:
        value = "n/a" if t["ratio"] is None else f"{t['ratio']:.2f}x"
        print(f"    {t['what']:<44} {value:>7}  target >= {t['target']:.1f}x  {'met' if t['met'] else 'MISSED'}")


def _random_ids(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


def _vocab_size(model_dir: Path) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(model_dir, local_files_only=True))


def _ct2_vocabulary(model_dir: Path) -> list[str]:
    return json.loads((model_dir / "vocabulary.json").read_text())

"""Helpers shared by the benchmark scripts: cached models, copy bandwidth, phase timing.

Owns nothing persistent except the benchmark models it builds under the pdserve cache
(one directory per arch × size × dtype, built aside and renamed so a concurrent or
interrupted build never leaves a half-written directory). Never downloads anything.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

from pdserve.cluster_process import ClusterProcess
from pdserve.model_factory import ensure_cached_model

def ensure_model(arch: str, size: str, dtype: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Build `arch`/`size` in `dtype` once under the cache dir; reuse it afterwards."""
    return ensure_cached_model(f"bench-{arch}-{size}-{dtype}", arch, size, getattr(torch, dtype), cache_dir)


def copy_bandwidth(num_bytes: int, rounds: int = 5) -> float:
    """Best memory bandwidth of a large tensor copy, in bytes/s, counting bytes read + written.

    Read + written is the STREAM "copy" convention; it is the larger of the two usual
    figures, so a floor derived from it is the stricter one.
    """
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters; tied weights count once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def read_bandwidth(num_bytes: int, rounds: int = 5) -> float:
    """Best read-only memory bandwidth in bytes/s: a sum over a buffer far larger than the caches.

    This is the rate at which a decode step streams its weights, so floors of one-stream
    decode (weight bytes / bandwidth) use it.
    """
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    src.sum()  # fault the pages in before timing
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


class Stopwatch:
    """Wall and process-CPU seconds of a block, with the 1-minute load average around it.

    On a shared machine the load average says how contended a phase was; CPU seconds
    (all threads of this process) show how much of the wall time we actually ran.
    """

    def __init__(self) -> None:
        self.wall_s = 0.0
        self.cpu_s = 0.0
        self.load_before = self.load_after = 0.0
        self._wall0 = self._cpu0 = 0.0

    def __enter__(self) -> Stopwatch:
        self.load_before = os.getloadavg()[0]
        self._wall0, self._cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._wall0
        self.cpu_s = time.process_time() - self._cpu0
        self.load_after = os.getloadavg()[0]

    def to_dict(self) -> dict:
        """The load averages; wall_s and cpu_s are the caller's to place."""
        return {
            "loadavg_1min_before": self.load_before,
            "loadavg_1min_after": self.load_after,
        }


@contextlib.contextmanager
def capture_logger(name: str, level: int = logging.WARNING) -> Iterator[list[str]]:
    """Collect the named logger's records into a list instead of letting them print."""
    lines: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(f"{record.levelname}: {record.getMessage()}")

    logger = logging.getLogger(name)
    saved = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [_Collect(level)], False
    try:
        yield lines
    finally:
        logger.handlers, logger.propagate = saved


def chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def left_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask of a left-padded batch, as transformers' `generate` expects."""
    width = max(len(p) for p in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [batch, width]
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, prompt in enumerate(batch):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return input_ids, mask


class OneStreamEngine:
    """An engine serving one request at a time, timed step by step: one-stream decode and
    prefill rates for the benchmarks that compare against single-stream tools (llama-bench)."""

    def __init__(self, model_dir: Path, prefill_tokens: int, **engine_kwargs) -> None:
        from pdserve import LLM

        self.llm = LLM(model_dir, enable_prefix_caching=False, max_num_batched_tokens=prefill_tokens, **engine_kwargs)
        self._count = 0
        self._steps([1, 2, 3, 4], 4)  # warm-up

    def decode(self, prompt: list[int], tokens: int) -> float:
        """tok/s of the steps after the prompt's (which samples the first token)."""
        steps = self._steps(prompt, tokens)
        return (len(steps) - 1) / sum(steps[1:])

    def prefill(self, prompt: list[int]) -> float:
        return len(prompt) / self._steps(prompt, 1)[0]

    def _steps(self, prompt: list[int], tokens: int) -> list[float]:
        from pdserve import SamplingParams

        engine = self.llm.engine
        self._count += 1
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        engine.add_request(f"one-stream-{self._count}", prompt, params)
        times = []
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return times


@contextlib.contextmanager
def local_cluster(model_dir: str | os.PathLike, pools: Sequence[str], node_args: Sequence[str],
                  extra: Sequence[str] = (), auth_token: str | None = None,
                  kind_args: Mapping[str, Sequence[str]] | None = None) -> Iterator[ClusterProcess]:
    """`pdserve cluster --model MODEL <pools> --dtype auto ...` as users start it, stopped on exit.

    `pools`: e.g. ("--prefill", "1", "--decode", "1") or ("--colocated", "2"); `node_args`:
    flags for every node of every pool; `kind_args`: more flags for one kind's nodes only, e.g.
    {"decode": ("--tp", "2")}; `extra`: more launcher flags (cores, router args).
    """
    kind_args = kind_args or {}
    pool_args = [arg for kind in ("prefill", "decode", "colocated")
                 for arg in (f"--{kind}-args", shlex.join([*node_args, *kind_args.get(kind, ())]))]
    flags = ["--model", str(model_dir), *pools, "--dtype", "auto", "--http-port", "0", *pool_args, *extra]
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as workdir:
        with ClusterProcess(flags, workdir, auth_token=auth_token) as cluster:
            yield cluster

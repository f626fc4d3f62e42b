"""`pdserve profile`'s measuring: the real engine's steps, timed on the real model, fitted.

Builds an `EngineCore` for the model folder with the setup's threads, dtype and block size, then
times `ModelRunner.execute` on packed steps of known shapes — prefill chunks of several lengths
after several contexts, decode batches of several sizes over several contexts, and decodes mixed
with a prefill chunk — exactly as pdserve/engine/step_profile.py times the target-step schedule's steps:
dummy requests holding real blocks (KV contents are irrelevant to timing), freed after, nothing
published to the prefix cache. One warm-up run per shape, then the median of a few. The KV
transfer cost is that of a real push: pdserve/bench/kv_transfer.py's UCX sender and receiver processes
(the shared-memory path), push to acknowledgement for the KV of a short and of a long prompt of
this model's shape; where UCX cannot run here, the copy of blocks out of one cache into another in
this process (a gather and a scatter, a lower bound of a push), and the profile says which.

Must never: run while the engine serves requests (it is its own engine), or be imported by the
simulator (it loads torch and the model).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterator

import torch
from tqdm import tqdm

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.model_runner import kv_block_bytes
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from pdserve.engine.step_shape import StepShape
from pdserve.planner.profile import NodeSetup, Profile, StepSample, TransferCost, machine_facts, model_hash
from pdserve.planner.step_cost import StepCost

logger = logging.getLogger(__name__)

REPEATS = 5  # timed runs per shape after one warm-up; the median is kept
PREFILL_TOKENS = (16, 64, 256, 1024)
PREFILL_CONTEXTS = (0, 1024)
DECODE_BATCHES = (1, 4, 16, 64)
DECODE_CONTEXTS = (128, 1024)
MIXED = ((16, 256, 128), (16, 256, 512))  # (decodes, their context, prefill chunk tokens)
TRANSFER_BLOCKS = (4, 64)
UCX_PUSH_TOKENS = (64, 1024)  # the KV of a short and of a long prompt
UCX_PUSH_REPEATS = 20  # pushes one at a time, then as many pipelined: enough CPU time to read


def step_shapes(max_model_len: int) -> Iterator[tuple[str, list[tuple[int, int]]]]:
    """(kind, [(tokens computed before, tokens scheduled)] per request) of every timed step, each
    request's tokens kept within the model's length."""
    room = max_model_len - 1
    for context in PREFILL_CONTEXTS:
        for tokens in PREFILL_TOKENS:
            if context + tokens <= room:
                yield "prefill", [(context, tokens)]
    for context in DECODE_CONTEXTS:
        for batch in DECODE_BATCHES:
            if context + 1 <= room:
                yield "decode", [(context, 1)] * batch
    for decodes, context, chunk in MIXED:
        if max(context + 1, chunk) <= room:
            yield "mixed", [(context, 1)] * decodes + [(0, chunk)]


def blocks_for(shapes: list[list[tuple[int, int]]], block_size: int) -> int:
    return max(sum(-(-(c + n) // block_size) for c, n in chunks) for chunks in shapes) + 1


def measure_profile(model_dir: str, setup: NodeSetup, progress: bool = True) -> Profile:
    """Time the grid of steps on the model with `setup` (its dtype already resolved) and fit them.
    A tensor-parallel setup starts its ranks as a node does (`start_engine`: rank 0 here, the
    others spawned, each with its share of the threads) and times the steps they run together."""
    from pdserve.ranks.tp_group import start_engine

    grid = list(step_shapes(1 << 30))
    tp = setup.tensor_parallel_size
    config = EngineConfig(model=model_dir, dtype=setup.dtype, block_size=setup.block_size,
                          num_blocks=blocks_for([c for _, c in grid], setup.block_size),
                          num_threads=max(1, setup.threads // tp), tensor_parallel_size=tp,
                          enable_prefix_caching=False, max_num_batched_tokens=max(PREFILL_TOKENS),
                          max_num_seqs=max(DECODE_BATCHES) + 1)
    machine = machine_facts()  # before the ranks start: rank 0 (this process) is then pinned to its share
    core, group = start_engine(config)
    try:
        return _measured(core, model_dir, setup, machine, progress)
    finally:
        if group is not None:
            group.close()


def _measured(core: EngineCore, model_dir: str, setup: NodeSetup, machine: dict[str, object],
              progress: bool) -> Profile:
    shapes = list(step_shapes(core.max_model_len))
    samples = [time_step(core, kind, chunks) for kind, chunks in tqdm(
        shapes, desc=f"profile {setup.describe()}", unit="step", disable=not progress)]
    block_bytes = kv_block_bytes(core.loaded, setup.block_size, core.config.torch_dtype)
    fitted = [(s.shape, s.seconds) for s in samples]
    step = StepCost.fit(fitted)
    kinds = sorted({s.kind for s in samples})
    return Profile(
        model=str(model_dir), model_hash=model_hash(model_dir), machine=machine, setup=setup, step=step,
        fit_error={k: step.relative_error([(s.shape, s.seconds) for s in samples if s.kind == k]) for k in kinds},
        samples=tuple(samples), kv_block_bytes=block_bytes, transfer=measure_transfer(core, block_bytes),
        max_model_len=core.max_model_len, vocab_size=core.loaded.vocab_size)


def time_step(core: EngineCore, kind: str, chunks: list[tuple[int, int]]) -> StepSample:
    """Median seconds of one packed step of `chunks`, on dummy requests holding real blocks."""
    requests = []
    out = SchedulerOutput()
    for i, (computed, scheduled) in enumerate(chunks):
        request = Request(f"profile-{kind}-{i}", [1] * (computed + scheduled), SamplingParams(max_tokens=1), -1,
                          seed=0)
        if core.kv.allocate_slots(request, computed + scheduled) is None:
            raise RuntimeError("the profile's KV pool is too small for its own steps")
        request.num_computed_tokens = computed
        requests.append(request)
        out.scheduled.append(ScheduledRequest(request, scheduled))
    times = []
    for i in range(REPEATS + 1):
        start = time.perf_counter()
        core.runner.execute(out)
        if i:  # the first run warms caches and kernels up
            times.append(time.perf_counter() - start)
    for request in requests:
        core.kv.free(request)
    shape = StepShape.of(chunks)
    return StepSample(kind, shape.tokens, shape.requests, shape.attended, shape.decode_context, statistics.median(times))


def measure_transfer(core: EngineCore, block_bytes: int) -> TransferCost:
    """base + per byte of a UCX push between two processes, and the CPU it costs each end; or of
    an in-process copy without UCX (its CPU the sender's)."""
    try:
        return measure_ucx_push(core)
    except Exception as exc:  # no UCX here (import, transport or process failure): the copy instead
        logger.warning("KV transfer over UCX could not be measured (%s: %s); timing an in-process copy instead",
                       type(exc).__name__, exc)
        return measure_copy(core, block_bytes)


def measure_ucx_push(core: EngineCore) -> TransferCost:
    from pdserve.bench.kv_transfer import Shape, run_ucx

    loaded, config = core.loaded, core.config
    runs = []
    for tokens in UCX_PUSH_TOKENS:
        shape = Shape(tokens, loaded.num_layers, loaded.num_local_kv_heads, loaded.head_dim, config.block_size,
                      config.dtype)
        runs.append((shape.nbytes, run_ucx(shape, iters=UCX_PUSH_REPEATS, pipeline=1)))  # the nodes' data path
    time_line = _line([(nbytes, statistics.median(run.latencies)) for nbytes, run in runs])
    send = _line([(nbytes, run.send_cpu_s) for nbytes, run in runs])
    receive = _line([(nbytes, run.receive_cpu_s) for nbytes, run in runs])
    return TransferCost(*time_line, "UCX push to acknowledgement between two processes (the nodes' data path); "
                        "CPU: each process's over the pushes", *send, *receive)


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(base, per byte) of the line through two (bytes, seconds) points, neither below zero."""
    (x0, y0), (x1, y1) = points
    per_byte = max((y1 - y0) / (x1 - x0), 0.0)
    return max(y0 - per_byte * x0, 0.0), per_byte


def measure_copy(core: EngineCore, block_bytes: int) -> TransferCost:
    """base + per byte of copying KV blocks from one cache into scattered blocks of another."""
    loaded = core.loaded
    shape = (max(TRANSFER_BLOCKS) * 2, loaded.num_local_kv_heads, core.config.block_size, loaded.head_dim)
    dtype = core.config.torch_dtype
    src = [torch.zeros(shape, dtype=dtype) for _ in range(2 * loaded.num_layers)]
    dst = [torch.zeros(shape, dtype=dtype) for _ in range(2 * loaded.num_layers)]
    points = []
    for count in TRANSFER_BLOCKS:
        src_ids = torch.arange(0, 2 * count, 2)
        dst_ids = torch.arange(1, 2 * count, 2)
        times = []
        for i in range(REPEATS + 2):
            start = time.perf_counter()
            for s, d in zip(src, dst):
                d.index_copy_(0, dst_ids, s.index_select(0, src_ids))
            if i:
                times.append(time.perf_counter() - start)
        points.append((count * block_bytes, statistics.median(times)))
    line = _line(points)  # its CPU is the copy's own, on the sending side
    return TransferCost(*line, "in-process block gather + scatter (no UCX here: a lower bound of a push); "
                        "CPU: the copy's, the sender's", *line)

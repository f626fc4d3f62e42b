"""KV transfer throughput: UCX between two processes vs a local torch memory copy.

Moves the KV of one request (default: 512 tokens of a 30-layer, 3-KV-head, head_dim-64
bf16 model, block 16 -> 32 blocks, 11.8 MB) from a sender process into random,
non-contiguous reserved blocks of a receiver process, push() to ack, and prints:

  * memcpy     : torch copy_ of the same bytes, contiguous, in one process;
  * gather     : index_select of the blocks into a staging buffer (sender's local cost);
  * ucx <path> : one push at a time (latency) and `--pipeline` pushes in flight
                 (throughput), for the default data path (one endpoint with peer-failure
                 handling) and the opt-in fast path (shared memory), and how long
                 the push() call itself holds the caller, and the CPU a push costs the
                 sender's and the receiver's process (all their threads);

each with its ratio to memcpy. A script, never a timed test.

    python -m pdserve.bench.kv_transfer [--tokens 512] [--iters 20]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.config import DEFAULT_BLOCK_SIZE
from pdserve.kv_transfer import KVCacheSpec
from pdserve.kv_transfer.layout import gather, make_plan, staging_shape

TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Shape:
    tokens: int
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @property
    def blocks(self) -> int:
        return -(-self.tokens // self.block_size)  # the partial last block moves whole

    def spec(self) -> KVCacheSpec:
        return KVCacheSpec(model="bench", dtype=self.dtype, num_layers=self.layers,
                           num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                           block_size=self.block_size)

    def caches(self, num_blocks: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        spec = self.spec()
        shape = (num_blocks, self.kv_heads, self.block_size, self.head_dim)
        return ([torch.randn(shape).to(spec.torch_dtype) for _ in range(self.layers)],
                [torch.randn(shape).to(spec.torch_dtype) for _ in range(self.layers)])

    @property
    def nbytes(self) -> int:
        return 2 * self.layers * self.blocks * self.spec().block_nbytes(self.kv_heads)


def receiver(shape: Shape, cfg_kw: dict[str, Any], out: Any, cmd: Any) -> None:
    """Registers its cache and waits: "cpu" answers this process's CPU seconds so far (its UCX
    threads', which take the pushes), anything else ends it."""
    from pdserve.kv_transfer import KVTransferConfig, UcxTransport

    transport = UcxTransport(KVTransferConfig(**cfg_kw))
    k, v = shape.caches(4 * shape.blocks)
    out.put(transport.register(k, v, shape.spec()).to_bytes())
    while cmd.get(timeout=TIMEOUT_S) == "cpu":
        out.put(time.process_time())
    transport.close()


def sender(shape: Shape, cfg_kw: dict[str, Any], desc: bytes, iters: int, pipeline: int,
           out: Any, go: Any) -> None:
    """Warms up, says "warm" and waits for `go` (the receiver's CPU is read in between), then
    times its pushes and answers their latencies and its own CPU per push."""
    from pdserve.kv_transfer import KVDescriptor, KVTransferConfig, UcxTransport

    config = KVTransferConfig(**cfg_kw)
    transport = UcxTransport(config)
    k, v = shape.caches(2 * shape.blocks)
    transport.register(k, v, shape.spec())
    transport.connect(KVDescriptor.from_bytes(desc))
    rng = random.Random(0)

    def push(i: int) -> Any:
        src = rng.sample(range(2 * shape.blocks), shape.blocks)
        dst = rng.sample(range(4 * shape.blocks), shape.blocks)
        return transport.push(f"req-{i}", src, dst)

    def finish(handle: Any) -> None:
        if handle.wait(config.transfer_timeout_s).name != "SUCCESS":
            raise RuntimeError(f"push failed: {handle.error}")

    for i in range(3):  # warm-up: endpoints, staging buffers, page faults
        finish(push(i))
    out.put("warm")
    go.get(timeout=TIMEOUT_S)
    cpu_start = time.process_time()
    latencies, call_times = [], []
    for i in range(iters):
        start = time.perf_counter()
        handle = push(i)
        call_times.append(time.perf_counter() - start)
        finish(handle)
        latencies.append(time.perf_counter() - start)
    start = time.perf_counter()
    for handle in [push(i) for i in range(iters * pipeline)][::-1]:
        finish(handle)
    pipelined = (time.perf_counter() - start) / (iters * pipeline)
    cpu_per_push = (time.process_time() - cpu_start) / (iters + iters * pipeline)
    out.put((latencies, pipelined, statistics.median(call_times), cpu_per_push, transport.stats().failures))
    transport.close()


@dataclass(frozen=True)
class UcxRun:
    latencies: list[float]  # seconds from each push's call to its acknowledgement, one at a time
    pipelined: float  # seconds per push with `pipeline` in flight
    call_s: float  # the median push call's own seconds
    send_cpu_s: float  # the sender's process CPU per push (all its threads)
    receive_cpu_s: float  # the receiver's


def run_ucx(shape: Shape, iters: int, pipeline: int, fast: bool | None = None) -> UcxRun:
    """`fast`: the opt-in fast data path or not; None: the nodes' default."""
    ctx = mp.get_context("spawn")
    cfg_kw = {} if fast is None else dict(fast_data_path=fast)
    r_out, r_cmd, s_out, s_go = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    recv = ctx.Process(target=receiver, args=(shape, cfg_kw, r_out, r_cmd), daemon=True)
    recv.start()
    send = None
    try:
        desc = r_out.get(timeout=TIMEOUT_S)
        send = ctx.Process(target=sender, args=(shape, cfg_kw, desc, iters, pipeline, s_out, s_go),
                           daemon=True)
        send.start()
        if (said := s_out.get(timeout=TIMEOUT_S)) != "warm":
            raise RuntimeError(f"the sender said {said!r} before it was warm")
        r_cmd.put("cpu")
        receive_start = r_out.get(timeout=TIMEOUT_S)
        s_go.put("go")  # the receiver's CPU is read before the first timed push, not during it
        latencies, pipelined, call_s, send_cpu_s, failures = s_out.get(timeout=TIMEOUT_S)
        r_cmd.put("cpu")
        receive_cpu_s = (r_out.get(timeout=TIMEOUT_S) - receive_start) / (iters + iters * pipeline)
        assert failures == 0
        return UcxRun(latencies, pipelined, call_s, send_cpu_s, receive_cpu_s)
    finally:
        r_cmd.put("exit")
        for proc in (send, recv):
            if proc is not None:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()


def median_seconds(fn: Any, iters: int) -> float:
    fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def local_baselines(shape: Shape, iters: int) -> tuple[float, float]:
    """(memcpy seconds, gather seconds) for the same number of bytes."""
    src = torch.empty(shape.nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    memcpy = median_seconds(lambda: dst.copy_(src), iters)
    spec = shape.spec()
    k, v = shape.caches(2 * shape.blocks)
    ids = random.Random(1).sample(range(2 * shape.blocks), shape.blocks)
    plan = make_plan("bench", ids, list(range(shape.blocks)), None, None, spec,
                     2 * shape.blocks, spec, shape.blocks)
    staging = torch.empty(staging_shape(plan, spec), dtype=spec.torch_dtype)
    return memcpy, median_seconds(lambda: gather(plan, k, v, staging), iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--pipeline", type=int, default=2, help="pushes in flight x iters")
    parser.add_argument("--paths", default="default,fast", help="comma list of: default, fast")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = Shape(args.tokens, args.layers, args.kv_heads, args.head_dim, args.block_size,
                  args.dtype)
    gb = shape.nbytes / 1e9
    memcpy, gather_s = local_baselines(shape, args.iters)
    print(f"KV of {shape.tokens} tokens: {shape.blocks} blocks x {shape.layers} layers x K,V "
          f"= {shape.nbytes / 1e6:.2f} MB ({shape.dtype})")
    print(f"{'memcpy (torch copy_)':34s} {gb / memcpy:7.2f} GB/s  "
          f"{memcpy * 1e3:7.2f} ms  ratio 1.000")
    print(f"{'gather (index_select, sender)':34s} {gb / gather_s:7.2f} GB/s  "
          f"{gather_s * 1e3:7.2f} ms  ratio {memcpy / gather_s:.3f}")
    for path in args.paths.split(","):
        run = run_ucx(shape, args.iters, args.pipeline, fast=path == "fast")
        latencies, pipelined, call_s = run.latencies, run.pipelined, run.call_s
        lat = statistics.median(latencies)
        print(f"{'ucx ' + path + ' (1 in flight, median)':34s} {gb / lat:7.2f} GB/s  "
              f"{lat * 1e3:7.2f} ms  ratio {memcpy / lat:.3f}")
        print(f"{'ucx ' + path + ' (pipelined)':34s} {gb / pipelined:7.2f} GB/s  "
              f"{pipelined * 1e3:7.2f} ms  ratio {memcpy / pipelined:.3f}")
        print(f"{'  push() call returns in':34s} {call_s * 1e6:7.1f} us (median)")
        print(f"{'  CPU per push, sender / receiver':34s} {run.send_cpu_s * 1e3:7.2f} / {run.receive_cpu_s * 1e3:.2f} ms")


if __name__ == "__main__":
    main()

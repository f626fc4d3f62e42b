"""What one streamed message costs in grpc.aio on this machine: the floor under the router's CPU per token.

    python -m pdserve.bench.grpc_floor [--messages 40000] [--concurrency 8] [--rounds 3]

The router relays a token by reading it from a node's gRPC stream and writing it to a client's
(python -m pdserve.bench.http_front measures the whole router). Here a server process on uvloop
streams `GenerateResponse`s of one token each to this process, over `--concurrency` streams at
once, with nothing else to do: the server's CPU per message sent and this process's CPU per
message received (both from the kernel's accounting) are the gRPC part of that relay, whatever
the router does around it. Then the same tokens again with every stream's token of one step
in one message (`--concurrency` tokens each: what one multiplexed node-to-router stream per node
would carry), the receive cost per token. Prints the CPU capability and each round; the medians
are what to read, the machine being shared.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import resource
import statistics
import time

import grpc
import torch
import uvloop

from pdserve.common.proc_stat import process_cpu_s
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Tokens(pdserve_pb2_grpc.GenerationServicer):
    """`max_tokens` messages of `n` (the request's `n`) tokens each, yielding to the loop between them."""

    async def Generate(self, request, context):
        tokens = list(range(request.sampling_params.n or 1))
        for _ in range(request.sampling_params.max_tokens):
            yield pdserve_pb2.GenerateResponse(token_ids=tokens)


def _serve(ports: multiprocessing.Queue) -> None:
    async def main() -> None:
        server = grpc.aio.server()
        pdserve_pb2_grpc.add_GenerationServicer_to_server(_Tokens(), server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()
    uvloop.run(main())


async def _streams(stub, messages: int, streams: int, tokens_per_message: int) -> int:
    request = pdserve_pb2.GenerateRequest(sampling_params=pdserve_pb2.SamplingParams(
        max_tokens=messages // streams, n=tokens_per_message))

    async def one() -> int:
        return sum([len(r.token_ids) async for r in stub.Generate(request)])
    return sum(await asyncio.gather(*(one() for _ in range(streams))))


async def _round(address: str, server_pid: int, args: argparse.Namespace) -> dict[str, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        await _streams(stub, args.concurrency * 10, args.concurrency, 1)  # warm-up
        server_before, own_before, start = process_cpu_s(server_pid), _own_cpu_s(), time.perf_counter()
        tokens = await _streams(stub, args.messages, args.concurrency, 1)
        wall_s = time.perf_counter() - start
        send_us = (process_cpu_s(server_pid) - server_before) / tokens * 1e6
        receive_us = (_own_cpu_s() - own_before) / tokens * 1e6
        own_before = _own_cpu_s()
        # One stream carrying every stream's token of a step: `concurrency` tokens per message.
        joined = await _streams(stub, args.messages // args.concurrency, 1, args.concurrency)
        joined_us = (_own_cpu_s() - own_before) / joined * 1e6
    return {"send_us": send_us, "receive_us": receive_us, "receive_joined_us": joined_us,
            "messages_per_s": tokens / wall_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.grpc_floor", description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=40000, help="one-token messages per round")
    p.add_argument("--concurrency", type=int, default=8, help="streams at once")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if args.messages < args.concurrency * 10:
        p.error(f"--messages: at least 10 per stream ({args.concurrency * 10}), got {args.messages}")
    print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}", flush=True)
    ports: multiprocessing.Queue = multiprocessing.get_context("spawn").Queue()
    server = multiprocessing.get_context("spawn").Process(target=_serve, args=(ports,), daemon=True)
    server.start()
    try:
        address = f"127.0.0.1:{ports.get(timeout=30)}"
        rounds = [uvloop.run(_round(address, server.pid, args)) for _ in range(args.rounds)]
    finally:
        server.terminate()
        server.join(timeout=10)
    for i, r in enumerate(rounds, 1):
        print(f"round {i}: send {r['send_us']:.1f} µs CPU/message, receive {r['receive_us']:.1f}, "
              f"receive joined ({args.concurrency} tokens/message) {r['receive_joined_us']:.1f} µs CPU/token, "
              f"{r['messages_per_s']:.0f} messages/s")
    median = {k: statistics.median(r[k] for r in rounds) for k in ("send_us", "receive_us", "receive_joined_us")}
    print(f"median: send {median['send_us']:.1f} + receive {median['receive_us']:.1f} = "
          f"{median['send_us'] + median['receive_us']:.1f} µs CPU per relayed one-token message; "
          f"receive joined {median['receive_joined_us']:.1f} µs CPU/token "
          f"({median['receive_us'] / median['receive_joined_us']:.1f}x less)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

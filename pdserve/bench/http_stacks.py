"""Which HTTP stack the router's OpenAI front runs on: aiohttp against Starlette + uvicorn, measured.

    python -m pdserve.bench.http_stacks [--requests 200] [--tokens 64] [--concurrency 8]

For each stack, a server process on uvloop (the router's loop) answers `POST /v1/completions`
with a server-sent-event stream of `--tokens` OpenAI chunks, one per token, each produced by an
async generator that yields to the loop between tokens (as tokens arriving from nodes do). This
process drives `--concurrency` closed-loop streams of `--requests` requests in all, and reads the
server process's CPU time (/proc). Prints, per stack, the server's CPU per streamed token and per
request and the tokens per second; then the ratios Starlette/aiohttp. Only the framework differs:
the same chunks, the same JSON encoding, the same client. Needs `starlette` and `uvicorn`
(not dependencies of pdserve: `pip install starlette uvicorn httptools`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

import aiohttp
import torch
import uvloop

from pdserve.common.proc_stat import process_cpu_s
from pdserve.testing.waiting import until

START_TIMEOUT_S = 30.0  # for the server to listen
CHUNK = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "text": " token", "logprobs": None, "finish_reason": None}]}


async def chunks(tokens: int):
    for _ in range(tokens):
        await asyncio.sleep(0)  # a token arrives from a node
        yield b"data: " + json.dumps(CHUNK, separators=(",", ":")).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def serve_aiohttp(port: int) -> None:
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        async for chunk in chunks(body["max_tokens"]):
            await response.write(chunk)
        await response.write_eof()
        return response

    async def run() -> None:
        app = web.Application()
        app.add_routes([web.post("/v1/completions", completions)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        print("ready", flush=True)
        await asyncio.Event().wait()

    uvloop.run(run())


def serve_starlette(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def completions(request):
        body = await request.json()
        return StreamingResponse(chunks(body["max_tokens"]), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])

    async def run() -> None:
        # On a loop that is already running, as the router's would be: Server.serve(), not uvicorn.run().
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                               access_log=False, lifespan="off"))
        serving = asyncio.ensure_future(server.serve())
        await until(lambda: server.started, START_TIMEOUT_S)
        print("ready", flush=True)
        await serving

    uvloop.run(run())


SERVERS = {"aiohttp": serve_aiohttp, "starlette+uvicorn": serve_starlette}


async def drive(url: str, requests: int, tokens: int, concurrency: int) -> int:
    body = {"prompt": "x", "max_tokens": tokens, "stream": True}
    remaining = iter(range(requests))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def worker() -> int:
            count = 0
            for _ in remaining:
                async with http.post(url, json=body) as response:
                    async for line in response.content:
                        count += line.startswith(b"data: {")
            return count
        return sum(await asyncio.gather(*(worker() for _ in range(concurrency))))


def measure(stack: str, port: int, args: argparse.Namespace) -> dict:
    server = subprocess.Popen([sys.executable, "-m", "pdserve.bench.http_stacks", "--serve", stack,
                               "--port", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {stack} server did not start")
        url = f"http://127.0.0.1:{port}/v1/completions"
        uvloop.run(drive(url, args.concurrency, args.tokens, args.concurrency))  # warm-up
        before, start = process_cpu_s(server.pid), time.perf_counter()
        streamed = uvloop.run(drive(url, args.requests, args.tokens, args.concurrency))
        cpu_s, wall_s = process_cpu_s(server.pid) - before, time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=30)
    return {"tokens": streamed, "cpu_us_per_token": cpu_s / streamed * 1e6,
            "cpu_ms_per_request": cpu_s / args.requests * 1e3, "tokens_per_s": streamed / wall_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.http_stacks", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="each stack this many times, alternating; medians")
    p.add_argument("--port", type=int, default=18431)
    p.add_argument("--serve", choices=sorted(SERVERS), help=argparse.SUPPRESS)  # the server process
    args = p.parse_args(argv)
    if args.serve:
        SERVERS[args.serve](args.port)
        return 0
    print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}", flush=True)
    runs: dict[str, list[dict]] = {stack: [] for stack in SERVERS}
    for _ in range(args.rounds):
        for stack in SERVERS:
            runs[stack].append(measure(stack, args.port, args))
    result = {}
    for stack, measured in runs.items():
        result[stack] = {key: sorted(m[key] for m in measured)[len(measured) // 2] for key in measured[0]}
        r = result[stack]
        print(f"{stack:18}: {r['cpu_us_per_token']:6.1f} µs CPU/token, {r['cpu_ms_per_request']:5.2f} ms CPU/request, "
              f"{r['tokens_per_s']:7.0f} tokens/s")
    ratio = result["starlette+uvicorn"]["cpu_us_per_token"] / result["aiohttp"]["cpu_us_per_token"]
    print(f"starlette+uvicorn / aiohttp CPU per token: {ratio:.2f}x")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One real prefill node and one real decode node (processes on 127.0.0.1), no router.

The test plays the router: Decode → READY{layout id, block ids} → Prefill(layout id, the decode
node's address, block ids; the prefill node fetches the layout once) → token 1 from the Prefill
response, tokens 2..n from the Decode stream.
It checks what the router relies on: greedy tokens identical to transformers, both
nodes ending with zero blocks in use, exact KV byte counts on both sides, and a
cancelled Decode stream freeing its blocks before a shorter stream beside it ends. The decode
node runs with --local-prefill (a hybrid): whole requests sent to its Generate run beside the
imported ones, exactly. The nodes are pointed at a router address where nothing listens: they
must keep retrying quietly.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from pdserve.engine.model_loader import load_model
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2
from pdserve.testing.waiting import settled, until, wait_until
from tests.integration.reference import assert_matches, greedy_references

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (ucxx-cu12) is not installed")

START_TIMEOUT_S = 240.0  # two nodes importing torch and loading a model on a shared 2-core box
RPC_TIMEOUT_S = 60.0
BLOCK_SIZE = 16
PROMPT_LENGTHS = [1, 7, 16, 17, 40, 64, 100, 130]
MAX_TOKENS = [8, 12, 16, 5, 20, 9, 14, 10]
SEED = 1234


class Node:
    def __init__(self, kind: str, model_dir: Path, router: str, log_dir: Path) -> None:
        self.kind = kind
        self.log_path = log_dir / f"{kind}.log"
        self.out_path = log_dir / f"{kind}.out"
        self._log = open(self.log_path, "w")
        self._out = open(self.out_path, "w")
        args = [sys.executable, "-m", "pdserve", kind, "--model", str(model_dir), "--port", "0",
                "--router", router, "--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--num-blocks", "128",
                "--max-num-batched-tokens", "32", "--max-num-seqs", "16", "--threads", "1", "--lease-s", "20"]
        if kind == "decode":  # a hybrid: it also computes whole requests of its own (Generate)
            args.append("--local-prefill")
        # Own session: teardown signals the whole group (front and its engine-core child).
        self.proc = subprocess.Popen(args, stdout=self._out, stderr=self._log, start_new_session=True)
        self.address = ""

    def wait_listening(self, deadline: float) -> None:
        def listening() -> str | None:
            return next((line.rsplit(" ", 1)[-1].strip() for line in self.out_path.read_text().splitlines()
                         if "listening on" in line), None)

        def started() -> bool:
            if self.proc.poll() is not None and not listening():
                raise AssertionError(f"{self.kind} node did not start:\n{self.log_path.read_text()[-4000:]}")
            return bool(listening())

        wait_until(started, lambda: f"{self.kind} node starts:\n{self.log_path.read_text()[-4000:]}",
                   deadline - time.monotonic(), interval_s=0.2)
        self.address = listening()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def gone(self) -> bool:
        return self.proc.poll() is not None and not _group_alive(self.proc.pid)

    def close_logs(self) -> None:
        self._log.close()
        self._out.close()


def stop_all(nodes: list[Node]) -> None:
    """SIGTERM every node's group, then SIGKILL whatever is left; never leaves a process behind."""
    for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        for node in nodes:
            if not node.gone():
                node.signal(sig)
        settled(lambda: all(node.gone() for node in nodes), bool, wait_s, interval_s=0.1)
    for node in nodes:
        node.close_logs()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> Path:
    return tiny_llama


@pytest.fixture(scope="module")
def nodes(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    router = f"127.0.0.1:{_unused_port()}"  # nothing listens here
    started: list[Node] = []
    try:
        for kind in ("decode", "prefill"):
            started.append(Node(kind, model_dir, router, logs))
        deadline = time.monotonic() + START_TIMEOUT_S
        for node in started:
            node.wait_listening(deadline)
        yield {node.kind: node for node in started}
    finally:
        stop_all(started)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, 900) for _ in range(n)] for n in PROMPT_LENGTHS]


def sampling(max_tokens: int) -> pdserve_pb2.SamplingParams:
    return pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def play_router(channels, req_id: str, prompt: list[int], max_tokens: int, decode_address: str) -> list[int]:
    decode = node_pb2_grpc.DecodeNodeStub(channels["decode"])
    prefill = node_pb2_grpc.PrefillNodeStub(channels["prefill"])
    params = sampling(max_tokens)
    call = decode.Decode(node_pb2.SampleRequest(request_id=req_id, prompt_token_ids=prompt, sampling_params=params,
                                                seed=SEED), timeout=RPC_TIMEOUT_S)
    first = await call.read()
    assert first.WhichOneof("event") == "ready"
    assert len(first.ready.block_ids) == -(-len(prompt) // BLOCK_SIZE)
    reply = await prefill.Prefill(node_pb2.PrefillRequest(
        request_id=req_id, prompt_token_ids=prompt, sampling_params=params, seed=SEED,
        decode_kv_layout_id=first.ready.kv_layout_id, decode_address=decode_address,
        decode_block_ids=first.ready.block_ids), timeout=RPC_TIMEOUT_S)
    tokens = [reply.first_token_id]
    while True:
        event = await call.read()
        assert event is not grpc.aio.EOF, f"{req_id}: the stream ended without a finish_reason"
        tokens += event.tokens.token_ids
        if event.tokens.finish_reason != pdserve_pb2.FINISH_REASON_UNSPECIFIED:
            assert event.tokens.finish_reason == pdserve_pb2.FINISH_REASON_LENGTH
            return tokens


async def get_stats(channels) -> dict[str, node_pb2.NodeStats]:
    return {kind: await node_pb2_grpc.DecodeNodeStub(ch).GetStats(node_pb2.StatsRequest(), timeout=10)
            if kind == "decode" else await node_pb2_grpc.PrefillNodeStub(ch).GetStats(node_pb2.StatsRequest(),
                                                                                     timeout=10)
            for kind, ch in channels.items()}


async def stats_when(channels, predicate, timeout_s: float) -> dict[str, node_pb2.NodeStats]:
    """Both nodes' stats once `predicate(stats)` holds (TimeoutError after timeout_s)."""
    async def matching() -> dict[str, node_pb2.NodeStats] | None:
        stats = await get_stats(channels)
        return stats if predicate(stats) else None

    return await until(matching, timeout_s, interval_s=0.02)


async def wait_idle(channels, timeout_s: float = 10.0) -> dict[str, node_pb2.NodeStats]:
    """Both nodes' stats once neither holds a used or reserved block (or the last ones at timeout_s)."""
    try:
        return await stats_when(channels, lambda stats: all(s.used_blocks == 0 and s.reserved_blocks == 0
                                                            for s in stats.values()), timeout_s)
    except TimeoutError:
        return await get_stats(channels)


def run_async(nodes, body):
    async def main():
        channels = {kind: grpc.aio.insecure_channel(node.address) for kind, node in nodes.items()}
        try:
            return await body(channels)
        finally:
            for channel in channels.values():
                await channel.close()

    return asyncio.run(main())


def test_concurrent_requests_are_token_exact_and_free_every_block(nodes, model_dir):
    loaded = load_model(model_dir, torch.float32)
    block_bytes = 2 * loaded.num_layers * loaded.num_kv_heads * BLOCK_SIZE * loaded.head_dim * 4
    all_prompts = prompts()

    async def body(channels):
        before = await get_stats(channels)
        outputs = await asyncio.gather(*(play_router(channels, f"req-{i}", p, n, nodes["decode"].address)
                                         for i, (p, n) in enumerate(zip(all_prompts, MAX_TOKENS))))
        after = await wait_idle(channels)
        return before, outputs, after

    before, outputs, after = run_async(nodes, body)
    assert_matches(outputs, greedy_references(model_dir, all_prompts, MAX_TOKENS))
    assert after["prefill"].used_blocks == 0 and after["decode"].used_blocks == 0
    assert after["decode"].reserved_blocks == 0
    expected = sum(-(-n // BLOCK_SIZE) for n in PROMPT_LENGTHS) * block_bytes
    sent = after["prefill"].kv_transfer.bytes - before["prefill"].kv_transfer.bytes
    received = after["decode"].kv_transfer.bytes - before["decode"].kv_transfer.bytes
    assert sent == expected and received == expected
    assert after["prefill"].kv_transfer.failures == 0


async def start_stream(channels, req_id: str, prompt: list[int], max_tokens: int, decode_address: str):
    """Reserve, prefill and open the Decode stream of one request; the open call."""
    decode = node_pb2_grpc.DecodeNodeStub(channels["decode"])
    prefill = node_pb2_grpc.PrefillNodeStub(channels["prefill"])
    params = sampling(max_tokens)
    call = decode.Decode(node_pb2.SampleRequest(request_id=req_id, prompt_token_ids=prompt,
                                                sampling_params=params, seed=SEED), timeout=RPC_TIMEOUT_S)
    ready = (await call.read()).ready
    await prefill.Prefill(node_pb2.PrefillRequest(
        request_id=req_id, prompt_token_ids=prompt, sampling_params=params, seed=SEED,
        decode_kv_layout_id=ready.kv_layout_id, decode_address=decode_address, decode_block_ids=ready.block_ids),
        timeout=RPC_TIMEOUT_S)
    return call


async def read_tokens(call, tokens: list[int]) -> None:
    """Append the stream's decoded tokens as they come, until it ends."""
    while (event := await call.read()) is not grpc.aio.EOF:
        tokens += event.tokens.token_ids


def test_cancelling_a_decode_stream_frees_its_blocks_before_a_shorter_stream_beside_it_ends(nodes):
    # `cancel-me` has 1900 tokens to generate; `beside` joins it with 500. Both decode one
    # token per step, so had the cancel freed nothing, `cancel-me` would outlive `beside`.
    prompt, short = prompts()[-1], prompts()[1]

    async def body(channels):
        call = await start_stream(channels, "cancel-me", prompt, 1900, nodes["decode"].address)
        for _ in range(3):
            event = await call.read()
            assert event.tokens.finish_reason == pdserve_pb2.FINISH_REASON_UNSPECIFIED
        beside = await start_stream(channels, "beside", short, 500, nodes["decode"].address)
        beside_tokens = list((await beside.read()).tokens.token_ids)
        reading = asyncio.create_task(read_tokens(beside, beside_tokens))
        busy = (await get_stats(channels))["decode"]
        call.cancel()
        alone = (await stats_when(channels, lambda stats: stats["decode"].num_running
                                  + stats["decode"].num_waiting < 2, 60.0))["decode"]
        beside_was_running = not reading.done()
        await reading
        return busy, alone, beside_was_running, len(beside_tokens), await wait_idle(channels)

    busy, alone, beside_was_running, num_beside, idle = run_async(nodes, body)
    assert busy.num_running == 2 and busy.used_blocks > 0
    assert (alone.num_running, alone.num_waiting) == (1, 0) and beside_was_running
    assert num_beside == 500 - 1  # `beside` ran to its end (token 1 came from the prefill node)
    assert idle["decode"].used_blocks == 0 and idle["decode"].num_running == 0, idle["decode"]


def test_a_reservation_cancelled_before_its_kv_is_freed_at_once_and_a_late_prefill_lands_nowhere(nodes):
    prompt = prompts()[-2]

    async def body(channels):
        decode = node_pb2_grpc.DecodeNodeStub(channels["decode"])
        prefill = node_pb2_grpc.PrefillNodeStub(channels["prefill"])
        params = sampling(8)
        call = decode.Decode(node_pb2.SampleRequest(request_id="early-cancel", prompt_token_ids=prompt,
                                                    sampling_params=params, seed=SEED), timeout=RPC_TIMEOUT_S)
        ready = (await call.read()).ready
        call.cancel()  # before any KV: freed at once; the prefill below writes nothing
        # Freed before the Prefill is sent, and by the cancel: the poll gives up long before the 20 s lease.
        cancelled = (await wait_idle(channels))["decode"]
        await prefill.Prefill(node_pb2.PrefillRequest(
            request_id="early-cancel", prompt_token_ids=prompt, sampling_params=params, seed=SEED,
            decode_kv_layout_id=ready.kv_layout_id, decode_address=nodes["decode"].address,
            decode_block_ids=ready.block_ids), timeout=RPC_TIMEOUT_S)
        stats = await wait_idle(channels)
        return len(ready.block_ids), cancelled, stats

    num_blocks, cancelled, stats = run_async(nodes, body)
    assert num_blocks > 0 and (cancelled.reserved_blocks, cancelled.used_blocks) == (0, 0)
    assert stats["decode"].kv_transfer.transfers == cancelled.kv_transfer.transfers  # every push dropped
    assert stats["decode"].used_blocks == 0 and stats["decode"].reserved_blocks == 0
    assert stats["prefill"].used_blocks == 0


def test_a_prefill_names_the_decode_layout_by_id_and_a_bad_reference_is_refused_naming_it(nodes):
    prompt, address = prompts()[2], nodes["decode"].address

    async def body(channels):
        decode = node_pb2_grpc.DecodeNodeStub(channels["decode"])
        prefill = node_pb2_grpc.PrefillNodeStub(channels["prefill"])
        layout = await decode.GetKVLayout(node_pb2.KVLayoutRequest(), timeout=RPC_TIMEOUT_S)
        call = decode.Decode(node_pb2.SampleRequest(request_id="named", prompt_token_ids=prompt,
                                                    sampling_params=sampling(4), seed=SEED), timeout=RPC_TIMEOUT_S)
        ready = (await call.read()).ready
        call.cancel()
        other_run = ready.kv_layout_id.rsplit("/", 1)[0] + "/another-run"  # READY'd before a restart
        refusals = {}
        for name, layout_id, decode_address in (("no id", "", address), ("no address", ready.kv_layout_id, ""),
                                                ("other run", other_run, address)):
            try:
                await prefill.Prefill(node_pb2.PrefillRequest(
                    request_id=f"bad-{name}", prompt_token_ids=prompt, sampling_params=sampling(4), seed=SEED,
                    decode_kv_layout_id=layout_id, decode_address=decode_address, decode_block_ids=ready.block_ids),
                    timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                refusals[name] = (exc.code(), exc.details())
        return layout, ready, refusals, await wait_idle(channels)

    layout, ready, refusals, idle = run_async(nodes, body)
    assert layout.layout_id == ready.kv_layout_id and b'"ranks"' in layout.layout  # READY names what GetKVLayout has
    assert refusals["no id"] == (grpc.StatusCode.INVALID_ARGUMENT, "decode_kv_layout_id must not be empty")
    assert refusals["no address"] == (grpc.StatusCode.INVALID_ARGUMENT, "decode_address must not be empty")
    code, details = refusals["other run"]
    assert code is grpc.StatusCode.UNAVAILABLE and details.endswith("it started again since its READY")
    assert f"'{ready.kv_layout_id}'" in details and "another-run" in details
    assert [(s.used_blocks, s.reserved_blocks) for s in idle.values()] == [(0, 0), (0, 0)]


HYBRID_TOKENS = 12


def test_a_hybrid_decode_node_serves_its_own_prompts_beside_imported_ones(nodes, model_dir):
    all_prompts = prompts()[:4]
    refs = greedy_references(model_dir, all_prompts, [HYBRID_TOKENS] * len(all_prompts))

    async def generate(channels, req_id: str, prompt: list[int]) -> list[int]:
        call = node_pb2_grpc.ColocatedNodeStub(channels["decode"]).Generate(node_pb2.SampleRequest(
            request_id=req_id, prompt_token_ids=prompt, sampling_params=sampling(HYBRID_TOKENS), seed=SEED),
            timeout=RPC_TIMEOUT_S)
        return [t async for event in call for t in event.tokens.token_ids]

    decode_address = nodes["decode"].address

    async def body(channels):
        # Two computed on the decode node itself, two prefilled elsewhere: one engine, one batch.
        outs = await asyncio.gather(generate(channels, "own-0", all_prompts[0]),
                                    play_router(channels, "imported-1", all_prompts[1], HYBRID_TOKENS, decode_address),
                                    generate(channels, "own-2", all_prompts[2]),
                                    play_router(channels, "imported-3", all_prompts[3], HYBRID_TOKENS, decode_address))
        return outs, await wait_idle(channels)

    outs, stats = run_async(nodes, body)
    assert_matches(outs, refs)
    assert all(s.used_blocks == 0 and s.reserved_blocks == 0 for s in stats.values())


def test_the_front_never_imports_torch():
    code = ("import sys, pdserve.node_kinds, pdserve.node.front.server; "
            "print(sorted(m for m in ('torch', 'transformers', 'ucxx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_registration_retries_quietly_without_a_router(nodes):
    for node in nodes.values():
        log = node.log_path.read_text()
        assert node.proc.poll() is None, log[-2000:]
        assert log.count("unreachable") <= 1, log[-2000:]
        assert "Traceback" not in log, log[-4000:]

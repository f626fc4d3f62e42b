"""UCX KV transfer between two real processes on 127.0.0.1.

Each test spawns a decode-side receiver and a prefill-side sender (multiprocessing,
spawn), drives them over queues, and checks what a decode node relies on: exact bytes in
exactly the reserved blocks, the done message after the data, refusals of a mismatched
peer on both sides, exact counters, and a dead peer turning into FAILED in bounded time.
"""

from __future__ import annotations

import importlib.util
import io
import itertools
import multiprocessing as mp
import os
import queue
import random
import re
import signal
import time
from dataclasses import asdict
from typing import Any

import pytest
import torch

from pdserve.kv_transfer import KVCacheSpec

# find_spec, not import: children re-import this module and must not start UCX early.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None,
                                reason="ucxx (ucxx-cu12) is not installed")

STEP_TIMEOUT_S = 40.0  # any single wait on a child; each test stays well under 60 s
LAYERS, HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 16
SRC_BLOCKS, DST_BLOCKS = 48, 64
# A push to a dead peer ends by the broken connection, or the transfer_timeout_s (5 s) watchdog.
ENDED_IN_BOUNDED_TIME = r"sending to \S+ failed|connection to \S+ lost|timed out after 5\.0s"


def spec_kwargs(dtype: str, **overrides: Any) -> dict[str, Any]:
    kwargs = dict(model="tiny-llm", dtype=dtype, num_layers=LAYERS, num_kv_heads=HEADS,
                  head_dim=HEAD_DIM, block_size=BLOCK)
    kwargs.update(overrides)
    return kwargs


def make_caches(spec_kw: dict[str, Any], num_blocks: int, seed: int
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    spec = KVCacheSpec(**spec_kw)
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, spec.local_heads[1] - spec.local_heads[0], spec.block_size,
             spec.head_dim)

    def one() -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(spec.torch_dtype)

    return [one() for _ in range(spec.num_layers)], [one() for _ in range(spec.num_layers)]


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def loads(raw: bytes) -> Any:
    return torch.load(io.BytesIO(raw))


# -- child processes -----------------------------------------------------------------
def receiver_main(spec_kw: dict[str, Any], cfg_kw: dict[str, Any], out: Any, cmd: Any) -> None:
    from pdserve.kv_transfer import KVTransferConfig, UcxTransport

    k, v = make_caches(spec_kw, DST_BLOCKS, seed=2)
    transport = UcxTransport(KVTransferConfig(**cfg_kw))
    snapshots: list[bytes] = []
    # Runs on the transport thread the moment the done message is handled.
    transport.set_done_callback(lambda req_id, payload: snapshots.append(dumps((k, v))))
    out.put(("desc", transport.register(k, v, KVCacheSpec(**spec_kw)).to_bytes()))
    while True:
        op, arg = cmd.get(timeout=STEP_TIMEOUT_S * 2)
        if op == "exit":
            transport.close()
            return
        deadline = time.monotonic() + arg
        dones: list[tuple[str, bytes]] = []
        while len(dones) < 1 and time.monotonic() < deadline:
            dones += transport.poll_done()
            time.sleep(0.005)
        out.put(("report", dict(dones=dones, snapshots=snapshots, final=dumps((k, v)),
                                stats=asdict(transport.recv_stats()),
                                refusals=[str(e) for e in transport.handshake_refusals()])))


def sender_main(spec_kw: dict[str, Any], cfg_kw: dict[str, Any], desc: bytes,
                script: list[tuple], out: Any, cmd: Any) -> None:
    from pdserve.kv_transfer import (FingerprintMismatch, KVDescriptor, KVTransferConfig,
                                     UcxTransport)

    k, v = make_caches(spec_kw, SRC_BLOCKS, seed=1)
    config = KVTransferConfig(**cfg_kw)
    transport = UcxTransport(config)
    transport.register(k, v, KVCacheSpec(**spec_kw))
    try:
        transport.connect(KVDescriptor.from_bytes(desc))
    except FingerprintMismatch as exc:
        out.put(("refused", str(exc)))
        transport.close()
        return
    out.put(("connected", None))
    if cmd.get(timeout=STEP_TIMEOUT_S) != "go":
        return
    handles = [transport.push(*step[1:]) if step[0] == "push" else
               transport.send_done(*step[1:]) for step in script]
    states = [(h.wait(config.transfer_timeout_s + 5).name, h.error) for h in handles]
    out.put(("sent", dict(states=states, stats=asdict(transport.stats()))))
    transport.close()


def flooding_sender_main(spec_kw: dict[str, Any], cfg_kw: dict[str, Any], desc: bytes, out: Any,
                         cmd: Any) -> None:
    """Pushes every block, 4 pushes in flight, until one fails (it says so and waits to be
    told to exit) or it is killed; says when the first one landed."""
    from pdserve.kv_transfer import KVDescriptor, KVTransferConfig, UcxTransport

    k, v = make_caches(spec_kw, SRC_BLOCKS, seed=1)
    config = KVTransferConfig(**cfg_kw)
    transport = UcxTransport(config)
    transport.register(k, v, KVCacheSpec(**spec_kw))
    transport.connect(KVDescriptor.from_bytes(desc))
    blocks = list(range(SRC_BLOCKS))
    in_flight = [transport.push(f"req-{i}", blocks, blocks) for i in range(4)]
    for n in itertools.count(4):
        handle = in_flight.pop(0)
        if handle.wait(config.transfer_timeout_s + 5).name != "SUCCESS":
            out.put(("failed", handle.error))
            cmd.get(timeout=STEP_TIMEOUT_S)
            return
        if n == 4:
            out.put(("flowing", None))
        in_flight.append(transport.push(f"req-{n}", blocks, blocks))


# -- harness -------------------------------------------------------------------------
class Cluster:
    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = []

    def start(self, target: Any, *args: Any) -> tuple[Any, Any, Any]:
        out, cmd = self.ctx.Queue(), self.ctx.Queue()
        proc = self.ctx.Process(target=target, args=(*args, out, cmd), daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc, out, cmd

    def stop(self) -> None:
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def expect(q: Any, kind: str) -> Any:
    try:
        got_kind, payload = q.get(timeout=STEP_TIMEOUT_S)
    except queue.Empty:
        pytest.fail(f"child did not answer {kind!r} within {STEP_TIMEOUT_S}s")
    assert got_kind == kind, (got_kind, payload)
    return payload


@pytest.fixture
def cluster() -> Any:
    c = Cluster()
    yield c
    c.stop()


def random_script(seed: int) -> tuple[list[tuple], list[tuple[list[int], list[int], list[int]]]]:
    """Two chunks of a request (the second ends in the partial last block) plus a
    layer-subset push of another request; random, non-contiguous ids on both sides."""
    rng = random.Random(seed)
    src = rng.sample(range(SRC_BLOCKS), 9)
    dst = rng.sample(range(DST_BLOCKS), 9)
    moves = [(src[:5], dst[:5], list(range(LAYERS))),
             (src[5:7], dst[5:7], list(range(LAYERS))),   # dst[6]: partial last block
             (src[7:], dst[7:], [1, 3])]
    script = [("push", "req-a", *moves[0]), ("push", "req-b", *moves[2]),
              ("push", "req-a", *moves[1]), ("done", "req-a", b"\x07token1+logprobs")]
    return script, moves


def expected_state(spec_kw: dict[str, Any], moves: list[tuple]) -> tuple[list, list]:
    src_k, src_v = make_caches(spec_kw, SRC_BLOCKS, seed=1)
    dst_k, dst_v = make_caches(spec_kw, DST_BLOCKS, seed=2)
    for src_ids, dst_ids, layers in moves:
        for layer in layers:
            dst_k[layer][dst_ids] = src_k[layer][src_ids]
            dst_v[layer][dst_ids] = src_v[layer][src_ids]
    return dst_k, dst_v


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


# -- tests ---------------------------------------------------------------------------
@pytest.mark.parametrize(("dtype", "fast", "chunk_bytes"), [
    ("float32", True, 4096),       # shared-memory data endpoint, one message per layer
    ("bfloat16", True, 16 << 20),  # one data message per push
    ("bfloat16", False, 4096),     # data on the control endpoint (TCP), chunked
])
def test_byte_exact_transfer_done_after_data_and_counters(
        cluster: Cluster, dtype: str, fast: bool, chunk_bytes: int) -> None:
    spec_kw = spec_kwargs(dtype)
    cfg_kw = dict(fast_data_path=fast, chunk_bytes=chunk_bytes, transfer_timeout_s=20.0)
    _, r_out, r_cmd = cluster.start(receiver_main, spec_kw, cfg_kw)
    desc = expect(r_out, "desc")
    script, moves = random_script(seed=len(dtype) * 10 + fast)
    _, s_out, s_cmd = cluster.start(sender_main, spec_kw, cfg_kw, desc, script)
    expect(s_out, "connected")
    s_cmd.put("go")
    sent = expect(s_out, "sent")
    r_cmd.put(("report", STEP_TIMEOUT_S))
    report = expect(r_out, "report")
    r_cmd.put(("exit", 0))

    assert [s for s, _ in sent["states"]] == ["SUCCESS"] * 4, sent["states"]
    want_k, want_v = expected_state(spec_kw, moves)
    got_k, got_v = loads(report["final"])
    assert same_bytes(got_k, want_k) and same_bytes(got_v, want_v)  # and nothing else moved
    # The done message was handled only after every push queued before it had landed.
    assert report["dones"] == [("req-a", b"\x07token1+logprobs")]
    at_done_k, at_done_v = loads(report["snapshots"][0])
    assert same_bytes(at_done_k, want_k) and same_bytes(at_done_v, want_v)

    itemsize = KVCacheSpec(**spec_kw).torch_dtype.itemsize
    block = HEADS * BLOCK * HEAD_DIM * itemsize
    nbytes = sum(2 * len(layers) * len(ids) * block for ids, _, layers in moves)
    for stats in (sent["stats"], report["stats"]):
        assert (stats["bytes"], stats["blocks"], stats["transfers"], stats["failures"]) \
            == (nbytes, 9, 3, 0)
        assert stats["latency_s"] > 0


def test_fingerprint_mismatch_is_refused_on_both_sides(cluster: Cluster) -> None:
    _, r_out, r_cmd = cluster.start(receiver_main, spec_kwargs("bfloat16"), {})
    desc = expect(r_out, "desc")
    _, s_out, _ = cluster.start(sender_main, spec_kwargs("bfloat16", block_size=32), {},
                                desc, [])
    refused = expect(s_out, "refused")
    assert "fingerprint mismatch" in refused and "block_size: local=32 remote=16" in refused
    r_cmd.put(("report", 0.0))
    report = expect(r_out, "report")
    r_cmd.put(("exit", 0))
    assert len(report["refusals"]) == 1
    assert "block_size: local=16 remote=32" in report["refusals"][0]
    assert report["stats"]["bytes"] == 0


@pytest.mark.parametrize("fast", [True, False])
def test_dead_peer_fails_in_bounded_time(cluster: Cluster, fast: bool) -> None:
    spec_kw = spec_kwargs("float32")
    cfg_kw = dict(fast_data_path=fast, transfer_timeout_s=5.0)
    receiver, r_out, _ = cluster.start(receiver_main, spec_kw, cfg_kw)
    desc = expect(r_out, "desc")
    script = [("push", "req-a", [0, 1, 2], [3, 4, 5])]
    _, s_out, s_cmd = cluster.start(sender_main, spec_kw, cfg_kw, desc, script)
    expect(s_out, "connected")
    receiver.kill()
    receiver.join(timeout=10)
    s_cmd.put("go")
    sent = expect(s_out, "sent")
    (state, error), = sent["states"]
    assert state == "FAILED" and error
    assert re.search(ENDED_IN_BOUNDED_TIME, error), error
    assert (sent["stats"]["failures"], sent["stats"]["transfers"]) == (1, 0)


def test_silent_peer_times_out_instead_of_hanging(cluster: Cluster) -> None:
    """A receiver that is alive but never answers (SIGSTOP): the watchdog fails the push."""
    spec_kw = spec_kwargs("float32")
    cfg_kw = dict(transfer_timeout_s=3.0)
    receiver, r_out, _ = cluster.start(receiver_main, spec_kw, cfg_kw)
    desc = expect(r_out, "desc")
    script = [("push", "req-a", [0, 1], [7, 8]), ("done", "req-a", b"t")]
    _, s_out, s_cmd = cluster.start(sender_main, spec_kw, cfg_kw, desc, script)
    expect(s_out, "connected")
    os.kill(receiver.pid, signal.SIGSTOP)
    try:
        s_cmd.put("go")
        sent = expect(s_out, "sent")
    finally:
        os.kill(receiver.pid, signal.SIGCONT)
        receiver.kill()
    assert [state for state, _ in sent["states"]] == ["FAILED", "FAILED"]
    assert "timed out after 3.0s" in sent["states"][0][1]  # the watchdog, at transfer_timeout_s
    assert sent["stats"]["failures"] == 1


def test_tp2_sender_rank_fills_only_its_heads(cluster: Cluster) -> None:
    """Prefill TP=2 rank 1 (head 1 of 2) -> decode TP=1: only head 1 of the dst blocks moves."""
    dst_kw, src_kw = spec_kwargs("bfloat16"), spec_kwargs("bfloat16", head_range=(1, 2))
    _, r_out, r_cmd = cluster.start(receiver_main, dst_kw, {})
    desc = expect(r_out, "desc")
    script = [("push", "req-a", [40, 3, 17], [9, 60, 2]), ("done", "req-a", b"t")]
    _, s_out, s_cmd = cluster.start(sender_main, src_kw, {}, desc, script)
    expect(s_out, "connected")
    s_cmd.put("go")
    sent = expect(s_out, "sent")
    r_cmd.put(("report", STEP_TIMEOUT_S))
    report = expect(r_out, "report")
    r_cmd.put(("exit", 0))
    assert [s for s, _ in sent["states"]] == ["SUCCESS", "SUCCESS"]
    src_k, src_v = make_caches(src_kw, SRC_BLOCKS, seed=1)  # [blocks, 1 head, ...]
    want_k, want_v = make_caches(dst_kw, DST_BLOCKS, seed=2)
    for layer in range(LAYERS):
        want_k[layer][[9, 60, 2], 1:2] = src_k[layer][[40, 3, 17]]
        want_v[layer][[9, 60, 2], 1:2] = src_v[layer][[40, 3, 17]]
    got_k, got_v = loads(report["final"])
    assert same_bytes(got_k, want_k) and same_bytes(got_v, want_v)
    assert sent["stats"]["bytes"] == 2 * LAYERS * 3 * BLOCK * HEAD_DIM * 2  # 1 head, bf16


@pytest.mark.parametrize(("sender_fast", "receiver_fast"), [(True, False), (False, True)])
def test_data_path_is_agreed_when_configs_differ(cluster: Cluster, sender_fast: bool,
                                                 receiver_fast: bool) -> None:
    spec_kw = spec_kwargs("float32")
    _, r_out, r_cmd = cluster.start(receiver_main, spec_kw, dict(fast_data_path=receiver_fast))
    desc = expect(r_out, "desc")
    script = [("push", "req-a", [5, 6], [1, 0]), ("done", "req-a", b"t")]
    _, s_out, s_cmd = cluster.start(sender_main, spec_kw,
                                    dict(fast_data_path=sender_fast, transfer_timeout_s=10.0),
                                    desc, script)
    expect(s_out, "connected")
    s_cmd.put("go")
    sent = expect(s_out, "sent")
    r_cmd.put(("report", STEP_TIMEOUT_S))
    report = expect(r_out, "report")
    r_cmd.put(("exit", 0))
    assert [s for s, _ in sent["states"]] == ["SUCCESS", "SUCCESS"], sent["states"]
    want_k, want_v = expected_state(spec_kw, [([5, 6], [1, 0], list(range(LAYERS)))])
    got_k, got_v = loads(report["final"])
    assert same_bytes(got_k, want_k) and same_bytes(got_v, want_v)



SPEC_OF_BIG_PUSHES = dict(num_kv_heads=8, head_dim=128)  # 12 MiB a push, 4 in flight


def test_a_sender_killed_mid_push_leaves_the_receiver_alive(cluster: Cluster) -> None:
    """SIGKILL senders while their pushes stream: the receiver lives on, answers, and takes the
    next sender's pushes. With the default data path (one endpoint with peer-failure handling).
    The opt-in fast path fails this: its first kill aborts the receiver (UCX reading the dead
    sender's memory with CMA), or, without CMA, some kill wedges its shared-memory queue."""
    spec_kw = spec_kwargs("float32", **SPEC_OF_BIG_PUSHES)
    cfg_kw = dict(transfer_timeout_s=5.0)
    receiver, r_out, r_cmd = cluster.start(receiver_main, spec_kw, cfg_kw)
    desc = expect(r_out, "desc")
    for _ in range(6):  # each kill lands at some point of a push
        sender, s_out, _ = cluster.start(flooding_sender_main, spec_kw, cfg_kw, desc)
        expect(s_out, "flowing")
        time.sleep(random.uniform(0.0, 0.05))  # not a condition: where in the stream the kill lands
        sender.kill()
        sender.join(timeout=10)
        r_cmd.put(("report", 0.0))
        report = expect(r_out, "report")
        assert receiver.exitcode is None and report["stats"]["transfers"] > 0
    r_cmd.put(("exit", 0))


def test_a_receiver_killed_mid_push_fails_the_push_and_leaves_the_sender_alive(cluster: Cluster) -> None:
    spec_kw = spec_kwargs("float32", **SPEC_OF_BIG_PUSHES)
    cfg_kw = dict(transfer_timeout_s=5.0)
    receiver, r_out, _ = cluster.start(receiver_main, spec_kw, cfg_kw)
    sender, s_out, s_cmd = cluster.start(flooding_sender_main, spec_kw, cfg_kw, expect(r_out, "desc"))
    expect(s_out, "flowing")
    time.sleep(random.uniform(0.0, 0.05))  # not a condition: where in the stream the kill lands
    receiver.kill()
    error = expect(s_out, "failed")
    assert sender.exitcode is None
    assert re.search(ENDED_IN_BOUNDED_TIME, error), error
    s_cmd.put("exit")

"""The torch.distributed KV transport end to end: `pdserve cluster` with `--kv-transport torch`
on every prefill and decode node, the KV over gloo on 127.0.0.1 (host caches).

- 1P1D: greedy float32 streams token-identical to transformers, exactly the prompts' blocks
  counted as sent (and received, but for what a one-token request's decode side dropped), zero
  blocks held after.
- 2P2D with a peer killed mid-transfer: a prefill node SIGKILLed while it prefills (and pushes)
  a long prompt, then a decode node SIGKILLed while a long prompt's KV streams into it: each
  request is retried elsewhere, exact tokens, nothing held after.
- A prefill node on torch and a decode node on UCX: refused, naming the transport.
- 1P2D with the fault drill `--debug-corrupt-kv-push 1`: the corrupted push is refused by its
  decode node's checksum, counted once, and the sample resumes elsewhere with exact tokens.
"""

from __future__ import annotations

import asyncio
import importlib.util

import grpc
import pytest

from pdserve.proto import pdserve_pb2

from tests.e2e.cluster import (FaultCluster, FaultSettings, NodeSettings, assert_every_block_free, assert_no_blocks_held,
                               running_cluster)
from tests.e2e.test_kv_integrity import MAX_TOKENS as DRILL_TOKENS, PROMPT as DRILL_PROMPT, generate
from tests.e2e.test_cluster import BLOCK_SIZE, kv_bytes_per_block, run_concurrently
from tests.e2e.test_node_failure import BLOCKS_FREED_S, LONG_PROMPT, SETTINGS, Stream, greedy, mid_prefill, prompt
from tests.integration.reference import assert_matches, greedy_references

TORCH = ("--kv-transport", "torch")
PROMPT_LENS = [1, 9, 17, 30, 64, 65, 120, 200]
NEW_TOKENS = [12, 1, 16, 8, 20, 12, 16, 8]


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


def test_one_prefill_one_decode_over_gloo_is_token_exact_with_every_byte_counted(model_dir):
    prompts = [prompt(n, seed=20 + i) for i, n in enumerate(PROMPT_LENS)]
    refs = greedy_references(model_dir, prompts, NEW_TOKENS)
    with running_cluster(model_dir, 1, 1, NodeSettings(block_size=BLOCK_SIZE), prefill_args=TORCH,
                         decode_args=TORCH) as cluster:
        streams = asyncio.run(run_concurrently(cluster.router, prompts, NEW_TOKENS))
        assert_matches([[t for r in stream for t in r.token_ids] for stream in streams], refs)
        block_bytes = kv_bytes_per_block(model_dir)
        for p, stream in zip(prompts, streams):
            assert stream[-1].timings.kv_transfer_bytes == -(-len(p) // BLOCK_SIZE) * block_bytes
        stats = cluster.wait_all_blocks_free(timeout_s=10)
        assert [(s.used_blocks, s.reserved_blocks) for s in stats] == [(0, 0), (0, 0)]
        expected = sum(-(-len(p) // BLOCK_SIZE) for p in prompts) * block_bytes
        (prefill,), (decode,) = [[s for s in stats if s.kind == kind] for kind in ("prefill", "decode")]
        assert (prefill.kv_transfer.bytes, prefill.kv_transfer.failures) == (expected, 0)
        # A request token 1 ends has its reservation cancelled at once: its KV may be dropped there.
        one_token = sum(-(-len(p) // BLOCK_SIZE) for p, n in zip(prompts, NEW_TOKENS) if n == 1) * block_bytes
        assert expected - one_token <= decode.kv_transfer.bytes <= expected


def mid_prefill_decode(cluster: FaultCluster) -> str:
    """The decode node the long prompt's KV streams into: the one holding a reservation."""
    for name in (n for n in cluster.live_nodes() if n.startswith("decode")):
        if cluster.stats(name).reserved_blocks:
            return name
    raise AssertionError("no decode node holds a reservation")


def test_a_peer_killed_mid_transfer_is_retried_elsewhere_exactly_and_leaks_nothing(model_dir, tmp_path):
    settings = FaultSettings(**{**SETTINGS.__dict__, "prefill_args": TORCH, "decode_args": TORCH})
    ids = [prompt(LONG_PROMPT, seed=30), prompt(LONG_PROMPT, seed=31)]
    refs = greedy_references(model_dir, ids, [12, 12])
    with FaultCluster(model_dir, tmp_path, 2, 2, settings) as cluster:
        for ids_i, ref, kind in zip(ids, refs, ("prefill", "decode")):
            async def scenario() -> Stream:
                stream = Stream(cluster.router, greedy(ids_i, 12))
                found: dict[str, str] = {}

                def pushing() -> bool:
                    prefill = mid_prefill(cluster, num_chunks_done=3)
                    if prefill is not None and "victim" not in found:
                        found["victim"] = prefill if kind == "prefill" else mid_prefill_decode(cluster)
                    return "victim" in found

                await stream.until(pushing)
                cluster.kill(found["victim"])
                return await stream.done()

            stream = asyncio.run(scenario())
            assert stream.error is None, stream.error
            assert_matches([stream.tokens], [ref])
            assert stream.responses[-1].finish_reason == pdserve_pb2.FINISH_REASON_LENGTH
            assert_no_blocks_held(cluster, BLOCKS_FREED_S)


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (ucxx-cu12) is not installed")
def test_a_prefill_node_on_another_transport_than_the_decode_node_is_refused_naming_it(model_dir):
    with running_cluster(model_dir, 1, 1, NodeSettings(block_size=BLOCK_SIZE), prefill_args=TORCH) as cluster:
        with pytest.raises(grpc.RpcError) as refusal:
            asyncio.run(run_concurrently(cluster.router, [prompt(20, seed=40)], [4]))
        assert "transport: local='torch' remote='ucx'" in refusal.value.details()
        assert "--kv-transport" in refusal.value.details()
        stats = cluster.wait_all_blocks_free(timeout_s=10)
        assert [(s.used_blocks, s.reserved_blocks) for s in stats] == [(0, 0), (0, 0)]


def test_a_push_corrupted_after_sealing_is_refused_and_the_sample_resumes_exactly(model_dir):
    with running_cluster(model_dir, 1, 2, prefill_args=(*TORCH, "--debug-corrupt-kv-push", "1"),
                         decode_args=TORCH) as cluster:
        tokens = generate(cluster.router, DRILL_PROMPT)
        assert_matches([tokens], greedy_references(model_dir, [DRILL_PROMPT], [DRILL_TOKENS]))
        prefill, *decodes = cluster.stats()
        assert sum(d.kv_transfer.checksum_failures for d in decodes) == 1
        assert (prefill.kv_transfer.failures, prefill.kv_transfer.checksum_failures) == (1, 0)
        assert_every_block_free(cluster)

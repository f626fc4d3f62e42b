"""The engine on CUDA (`--device cuda`), held to transformers as on the CPU: greedy float32 tokens
exact (but after a near-tie of the reference), every tensor on the GPU, no block left held.

- the offline `LLM` with device="cuda", on the native forward and on transformers' own
- a colocated node under `pdserve cluster` with `--device cuda`
- one prefill and one decode node with `--device cuda --kv-transport torch` on this GPU: the KV
  crosses over the pair's gloo group through a host copy (NCCL refuses two ranks on one device;
  with two GPUs, each node on its own, the same command moves it over NCCL)

Skipped, with the reason, where torch sees no CUDA device (tests/gpu/conftest.py).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from pdserve import LLM, SamplingParams
from tests.e2e.cluster import NodeSettings, running_cluster
from tests.e2e.test_cluster import BLOCK_SIZE, kv_bytes_per_block, run_concurrently
from tests.integration.reference import assert_matches, greedy_references

PROMPT_LENS = [1, 9, 17, 30, 64, 65, 120, 200]
NEW_TOKENS = [12, 16, 16, 8, 20, 12, 16, 8]
CUDA = ("--device", "cuda")


@pytest.fixture(scope="module")
def workload(tiny_llama):
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 900) for _ in range(n)] for n in PROMPT_LENS]
    return prompts, greedy_references(tiny_llama, prompts, NEW_TOKENS)


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_the_offline_engine_on_cuda_is_token_exact_and_lives_on_the_gpu(tiny_llama, workload, impl):
    prompts, refs = workload
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in NEW_TOKENS]
    with LLM(tiny_llama, device="cuda", dtype="float32", model_impl=impl, block_size=8, num_blocks=512) as llm:
        engine = llm.engine
        assert engine.config.device == "cuda"
        assert {p.device.type for p in engine.loaded.model.parameters()} == {"cuda"}
        assert {c.device.type for c in [*engine.runner.k_caches, *engine.runner.v_caches]} == {"cuda"}
        outputs = llm.generate(prompts, params)
        assert_matches([o.outputs[0].token_ids for o in outputs], refs)
        assert engine.kv.num_used_blocks == 0


def test_a_colocated_node_on_cuda_is_token_exact(tiny_llama, workload):
    prompts, refs = workload
    with running_cluster(str(tiny_llama), 0, 0, NodeSettings(block_size=BLOCK_SIZE), num_colocated=1,
                         colocated_args=CUDA) as cluster:
        streams = asyncio.run(run_concurrently(cluster.router, prompts, NEW_TOKENS))
        assert_matches([[t for r in s for t in r.token_ids] for s in streams], refs)
        assert [s.used_blocks for s in cluster.wait_all_blocks_free(timeout_s=10)] == [0]


def test_one_prefill_one_decode_on_cuda_over_the_torch_transport(tiny_llama, workload):
    prompts, refs = workload
    args = (*CUDA, "--kv-transport", "torch")
    with running_cluster(str(tiny_llama), 1, 1, NodeSettings(block_size=BLOCK_SIZE), prefill_args=args,
                         decode_args=args) as cluster:
        streams = asyncio.run(run_concurrently(cluster.router, prompts, NEW_TOKENS))
        assert_matches([[t for r in s for t in r.token_ids] for s in streams], refs)
        block_bytes = kv_bytes_per_block(str(tiny_llama))
        for p, s in zip(prompts, streams):
            assert s[-1].timings.kv_transfer_bytes == -(-len(p) // BLOCK_SIZE) * block_bytes
        stats = cluster.wait_all_blocks_free(timeout_s=10)
        assert [(s.used_blocks, s.reserved_blocks) for s in stats] == [(0, 0), (0, 0)]
        expected = sum(-(-len(p) // BLOCK_SIZE) for p in prompts) * block_bytes
        assert [s.kv_transfer.bytes for s in stats] == [expected, expected]
        assert [s.kv_transfer.failures for s in stats] == [0, 0]

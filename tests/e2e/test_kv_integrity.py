"""KV integrity under `pdserve cluster`: a push whose bytes were corrupted after its sender took
their checksum (the fault drill `--debug-corrupt-kv-push`, pdserve/kv_transfer/integrity.py) is refused by
its decode node, which never admits the request; the router resumes the sample elsewhere and the
client gets exactly the tokens of the uncorrupted run, the refusal counted once, every block free.
"""

from __future__ import annotations

import importlib.util
import urllib.request

import grpc
import pytest

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.testing.waiting import settled
from tests.e2e.cluster import assert_every_block_free, running_cluster
from tests.integration.reference import assert_matches, greedy_references

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (ucxx-cu12) is not installed")

PROMPT = [5, 17, 42, 99, 7, 311, 12, 64, 250, 3, 88, 140, 9, 21, 600, 33, 45]
MAX_TOKENS = 8
RPC_TIMEOUT_S = 120.0
COUNTED = "\npdserve_kv_checksum_failures_total 1.0\n"


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as page:
        return page.read().decode()


def generate(router: str, ids: list[int]) -> list[int]:
    params = pdserve_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    request = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=ids), sampling_params=params)
    with grpc.insecure_channel(router) as channel:
        responses = pdserve_pb2_grpc.GenerationStub(channel).Generate(request, timeout=RPC_TIMEOUT_S)
        return [token for response in responses for token in response.token_ids]


def test_a_corrupted_push_is_refused_counted_and_the_sample_resumes_exactly(tiny_llama):
    model_dir = str(tiny_llama)
    with running_cluster(model_dir, 1, 2, metrics=True, prefill_args=("--debug-corrupt-kv-push", "1")) as cluster:
        tokens = generate(cluster.router, PROMPT)
        assert_matches([tokens], greedy_references(model_dir, [PROMPT], [MAX_TOKENS]))
        prefill, *decodes = cluster.stats()
        assert sum(d.kv_transfer.checksum_failures for d in decodes) == 1
        assert prefill.kv_transfer.failures == 1  # the refused push, acknowledged with its error
        assert prefill.kv_transfer.checksum_failures == 0
        refusing = [name for name, d in zip(cluster.names("decode"), decodes) if d.kv_transfer.checksum_failures]
        # The node's /metrics serves the snapshot its core pushes every 0.2 s.
        page = settled(lambda: scrape(cluster.metrics[refusing[0]]), lambda text: COUNTED in text, 30.0,
                       interval_s=0.1)
        assert COUNTED in page
        assert_every_block_free(cluster)

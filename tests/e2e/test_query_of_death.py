"""A request that fails every node it reaches (a query of death) under `pdserve cluster`: it fails
at most `--max-node-failures-per-request` node attempts, then ends INTERNAL with a message that
says so; the cluster serves everyone else, exactly, with every block free.

The poison is the nodes' fault drill `--debug-poison-token-id` (pdserve/node/core/fault_drills.py): a step
computing a prompt that holds the token fails as a model bug on some input would, raising
inside the model runner (the node fails the step's requests and serves on) or, with
`--debug-poison-action exit`, ending the engine core at once (the node dies and the launcher
starts it again).
"""

from __future__ import annotations

import importlib.util

import grpc
import pytest

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.testing.waiting import settled
from tests.e2e.cluster import FaultCluster, FaultSettings, assert_every_block_free, running_cluster
from tests.integration.reference import assert_matches, greedy_references

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (ucxx-cu12) is not installed")

POISON = 777
POISONED_PROMPT = [5, 17, POISON, 99, 7]
CLEAN_PROMPT = [5, 17, 42, 99, 7]
RPC_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


def generate(router: str, ids: list[int]) -> list[int]:
    params = pdserve_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    request = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=ids), sampling_params=params)
    with grpc.insecure_channel(router) as channel:
        responses = pdserve_pb2_grpc.GenerationStub(channel).Generate(request, timeout=RPC_TIMEOUT_S)
        return [token for response in responses for token in response.token_ids]


def poisoned_error(router: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as failed:
        generate(router, POISONED_PROMPT)
    return failed.value


def test_a_request_that_fails_its_steps_ends_internal_and_the_nodes_serve_on(model_dir):
    poison = ("--debug-poison-token-id", str(POISON))
    with running_cluster(model_dir, 1, 1, prefill_args=poison) as cluster:
        pids = dict(cluster.pids)
        error = poisoned_error(cluster.router)
        assert error.code() is grpc.StatusCode.INTERNAL
        assert error.details().startswith("3 of this request's node attempts failed, the last: prefill node ")
        assert (f"the model failed on a step of this request: RuntimeError: poisoned token {POISON} "
                "(--debug-poison-token-id)") in error.details()
        assert error.details().endswith("not sent to another node (--max-node-failures-per-request 3): "
                                        "the request itself may be what fails them")
        # Nothing died: the same processes serve the next request, exactly.
        assert_matches([generate(cluster.router, CLEAN_PROMPT)], greedy_references(model_dir, [CLEAN_PROMPT], [6]))
        assert cluster.refresh().children["prefill-0"].pid == pids["prefill-0"]
        prefill, decode = cluster.stats()
        assert (prefill.failed_requests, decode.failed_requests) == (3, 0)
        assert_every_block_free(cluster)


def test_a_request_that_crashes_its_nodes_kills_at_most_the_configured_number(model_dir, tmp_path):
    settings = FaultSettings(prefill_args=("--debug-poison-token-id", str(POISON), "--debug-poison-action", "exit"),
                             router_args=("--max-node-failures-per-request", "2"), restart_backoff_s=1.0)
    with FaultCluster(model_dir, tmp_path, 2, 1, settings) as cluster:
        before = cluster.pids()
        error = poisoned_error(cluster.router)
        # Had the bound not held, a third attempt would have found no prefill node: UNAVAILABLE.
        assert error.code() is grpc.StatusCode.INTERNAL
        assert error.details().startswith("2 of this request's node attempts failed, the last: prefill node ")
        # Both prefill nodes died, once each (the launcher starts them again); the decode node lives.
        restarted = restarted_nodes(cluster, before, 2)
        assert restarted == ["prefill-0", "prefill-1"], restarted
        cluster.wait_serving(2, 1, timeout_s=240)
        assert_matches([generate(cluster.router, CLEAN_PROMPT)], greedy_references(model_dir, [CLEAN_PROMPT], [6]))
        assert restarted_nodes(cluster, before, 2) == restarted  # and no other since
        held = cluster.wait_no_blocks(30.0)
        assert all(h == (0, 0) for h in held.values()), held


def restarted_nodes(cluster: FaultCluster, before: dict[str, int], expected: int, timeout_s: float = 60.0) -> list[str]:
    """The children whose pid changed since `before`, once `expected` have (or at the timeout)."""
    def changed() -> list[str]:
        after = cluster.pids()
        return sorted(name for name in before if after[name] != before[name])

    return settled(changed, lambda names: len(names) >= expected, timeout_s, interval_s=0.1)

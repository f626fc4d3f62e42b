"""A cluster across hosts: three Linux network namespaces joined by a bridge, each with its own
address, running the README's by-hand commands ("Several machines"): the router on one host,
a prefill node on another, two decode nodes on the third.

- Float32 greedy tokens equal transformers', and the KV crossed hosts over UCX: the prefill
  node counts the transfers and bytes it sent, the decode nodes what they received.
- Every listener binds the address its host was given, and nothing else: gRPC, metrics, and
  each KV transport's one socket, UCX's TCP listener (peers connect to UCX worker addresses:
  no connection listener).
- A decode node killed mid-stream (SIGKILL to its process group, a machine gone): the stream
  resumes on the other decode node, exactly, counted in `pdserve_resumes_total`.

Skips, saying why, where namespaces cannot be made (not root, no `ip`, no permission); the
namespaces and the bridge are deleted after the test, whatever happened.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys

import grpc
import pytest

from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc
from pdserve.testing import netns
from pdserve.testing.waiting import until, wait_until
from pdserve.testing.metrics import counter
from tests.e2e.test_drain import Stream, greedy, prompt
from tests.integration.reference import assert_matches, greedy_references

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (ucxx-cu12) is not installed")

ROUTER_PORT, PREFILL_PORT, DECODE_PORTS, METRICS_PORT = 50051, 50061, (50071, 50072), 9100
LONG_STREAM = 120  # tokens: ~6 s at the decode step delay, time to kill a node mid-stream
START_TIMEOUT_S = 300.0  # four processes importing torch on a shared 2-core box
# UCX sees one machine behind the namespaces and would move the KV through shared memory, whose
# signalling does not cross network namespaces (it hangs), or CMA (no network at all): TCP only,
# what it picks between real machines anyway.
NODE_FLAGS = ("--kv-ucx-tls", "tcp,self", "--dtype", "float32", "--block-size", "8", "--num-blocks", "256", "--max-num-batched-tokens", "16",
              "--max-num-seqs", "16",
              "--num-threads", "1", "--lease-s", "20")


@pytest.fixture(scope="module")
def hosts(tiny_llama, tmp_path_factory):
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"network namespaces cannot be made here: {why}")
    subnet = f"10.231.{os.getpid() % 250}"
    with netns.Hosts(("router", "prefill", "decode"), subnet, tmp_path_factory.mktemp("hosts")) as made:
        made.decode_procs = _start(made, str(tiny_llama))
        yield made


def _start(hosts: netns.Hosts, model_dir: str) -> dict[str, subprocess.Popen]:
    """The README's commands, one host each (two decode nodes on the third); the decode nodes'
    processes by address."""
    pdserve = (sys.executable, "-m", "pdserve")
    router = f"{hosts.addresses['router']}:{ROUTER_PORT}"
    hosts.run("router", "router", (*pdserve, "router", "--model", model_dir, "--host", hosts.addresses["router"],
                                   "--port", str(ROUTER_PORT), "--block-size", "8", "--heartbeat-timeout-s", "10",
                                   "--metrics-port", str(METRICS_PORT)))
    host = hosts.addresses["prefill"]
    hosts.run("prefill", "prefill", (*pdserve, "prefill", "--model", model_dir, "--host", host,
                                     "--port", str(PREFILL_PORT), "--kv-host", host, "--router", router,
                                     *NODE_FLAGS))
    host, decode = hosts.addresses["decode"], {}
    for i, port in enumerate(DECODE_PORTS):
        decode[f"{host}:{port}"] = hosts.run("decode", f"decode-{i}", (*pdserve, "decode", "--model", model_dir, "--host", host,
                                            "--port", str(port), "--kv-host", host, "--router", router,
                                            "--node-id", f"decode-{i}", "--debug-step-delay-s", "0.05",
                                            *NODE_FLAGS))
    def serving() -> bool:
        assert not hosts.exited(), f"exited: {hosts.exited()}: " + "\n".join(hosts.log(n)[-1500:] for n in hosts.exited())
        return _serving(router) == (1, 2)

    wait_until(serving,
               lambda: f"the router serves 1 prefill and 2 decode nodes (now {_serving(router)}):\n"
                       + "\n".join(hosts.log(n)[-1500:] for n in ("router", "prefill", "decode-0", "decode-1")),
               START_TIMEOUT_S, interval_s=0.5)
    return decode


def _serving(router: str) -> tuple[int, int] | None:
    with grpc.insecure_channel(router) as channel:
        try:
            health = pdserve_pb2_grpc.GenerationStub(channel).Health(pdserve_pb2.HealthRequest(), timeout=2.0)
        except grpc.RpcError:
            return None
    return health.prefill_nodes, health.decode_nodes


def router_of(hosts: netns.Hosts) -> str:
    return f"{hosts.addresses['router']}:{ROUTER_PORT}"


def stats(address: str, stub=node_pb2_grpc.DecodeNodeStub) -> node_pb2.NodeStats:
    with grpc.insecure_channel(address) as channel:
        return stub(channel).GetStats(node_pb2.StatsRequest(), timeout=5.0)


def decode_addresses(hosts: netns.Hosts) -> list[str]:
    return [f"{hosts.addresses['decode']}:{port}" for port in DECODE_PORTS]


def resumes(hosts: netns.Hosts) -> float:
    return sum(counter(f"http://{hosts.addresses['router']}:{METRICS_PORT}/metrics", "pdserve_resumes", "reason").values())


async def _served(router: str, request: pdserve_pb2.GenerateRequest) -> Stream:
    return await Stream(router, request).done()


def test_exact_tokens_with_the_kv_crossing_hosts_over_ucx(hosts, tiny_llama):
    prompts = [prompt(40, seed=1), prompt(17, seed=2)]
    refs = greedy_references(str(tiny_llama), prompts, [24, 24])
    prefill = f"{hosts.addresses['prefill']}:{PREFILL_PORT}"
    sent_before = stats(prefill, node_pb2_grpc.PrefillNodeStub).kv_transfer
    streams = [asyncio.run(_served(router_of(hosts), greedy(ids, 24))) for ids in prompts]
    assert [(s.code, s.details) for s in streams] == [(grpc.StatusCode.OK, "")] * 2
    assert_matches([s.tokens for s in streams], refs)
    sent = stats(prefill, node_pb2_grpc.PrefillNodeStub).kv_transfer
    received = [stats(address).kv_transfer for address in decode_addresses(hosts)]
    # Every prompt's blocks left the prefill host and landed on the decode host (40 + 17 tokens
    # in blocks of 8: at least 5 + 2 full blocks pushed, the partial ones too).
    assert sent.transfers - sent_before.transfers >= 2 and sent.bytes > sent_before.bytes
    assert sum(r.bytes for r in received) == sent.bytes and sum(r.blocks for r in received) == sent.blocks


def test_every_listener_binds_its_hosts_address_the_kv_ones_included(hosts):
    node_ports = {ROUTER_PORT, METRICS_PORT, PREFILL_PORT, *DECODE_PORTS}
    for host, kv_transports in (("prefill", 1), ("decode", 2), ("router", 0)):
        listeners = hosts.listeners(host)
        assert {_address(listener) for listener in listeners} == {hosts.addresses[host]}, f"{host}: {listeners}"
        if host != "router":  # a node listens on its --port and its KV transport's (UCX's TCP) port
            kv = [listener for listener in listeners if int(listener.rsplit(":", 1)[1]) not in node_ports]
            assert len(kv) == kv_transports, f"{host}: {listeners}"


def _address(listener: str) -> str:
    """`ss`'s ADDRESS:PORT, the address alone (an IPv4-mapped IPv6 address as its IPv4 one)."""
    address = listener.rsplit(":", 1)[0].strip("[]")
    return address.removeprefix("::ffff:")


def test_a_decode_node_killed_mid_stream_resumes_on_the_other_host_node(hosts, tiny_llama):
    ids = prompt(30, seed=3)
    [ref] = greedy_references(str(tiny_llama), [ids], [LONG_STREAM])
    before = resumes(hosts)
    procs = hosts.decode_procs

    async def scenario() -> Stream:
        stream = Stream(router_of(hosts), greedy(ids, LONG_STREAM))
        await until(lambda: len(stream.tokens) >= 10, timeout_s=60.0, interval_s=0.02)
        [busy] = [a for a in procs if stats(a).num_running]
        os.killpg(procs[busy].pid, signal.SIGKILL)  # the machine is gone: front and engine core at once
        return await stream.done()

    stream = asyncio.run(scenario())
    assert (stream.code, stream.details) == (grpc.StatusCode.OK, "")
    assert_matches([stream.tokens], [ref])
    assert resumes(hosts) == before + 1


def test_the_last_decode_node_drains_its_stream_across_hosts_and_exits_0(hosts, tiny_llama):
    """After the kill above one decode node is left: SIGTERM to it (a scale-down) with a stream
    running finishes the stream there — nowhere else could take it — and the node exits 0."""
    ids = prompt(30, seed=4)
    [ref] = greedy_references(str(tiny_llama), [ids], [40])
    [(address, proc)] = [(a, p) for a, p in hosts.decode_procs.items() if p.poll() is None]
    before = resumes(hosts)

    async def scenario() -> Stream:
        stream = Stream(router_of(hosts), greedy(ids, 40))
        await until(lambda: len(stream.tokens) >= 5, timeout_s=60.0, interval_s=0.02)
        proc.send_signal(signal.SIGTERM)  # the node's own process, as Kubernetes sends it
        return await stream.done()

    stream = asyncio.run(scenario())
    assert (stream.code, stream.details) == (grpc.StatusCode.OK, "")
    assert_matches([stream.tokens], [ref])
    assert proc.wait(timeout=60) == 0
    assert resumes(hosts) == before
    assert _serving(router_of(hosts)) == (1, 0)  # it deregistered: the router counts no decode node

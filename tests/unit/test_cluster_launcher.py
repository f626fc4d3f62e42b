"""`pdserve cluster`: command lines, the supervisor with dummy children, the launcher's lifecycle.

Children here are tiny Python scripts (sleepers, a fast exiter, one that ignores SIGTERM,
one that spawns a grandchild, a fake router serving only Health). Every test stops what
it starts through the supervisor, in a finally, and checks that nothing is left alive.
"""

from __future__ import annotations

import dataclasses
import io
import os
import random
import re
import signal
import socket
import sys
import threading
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.cluster import (
    ClusterConfig,
    ClusterError,
    ClusterPlan,
    build_plan,
    config_from_args,
    resolve_port,
    run_cluster,
)
from pdserve.cluster_load_mode import LoadModeSettings
from pdserve.cluster_plan import PICK_LOW, NodeSite, node_spec
from pdserve.cluster_state import read_state
from pdserve.cluster_supervisor import ChildExited, ChildSpec, ClusterSupervisor, RestartPolicy
from pdserve.healthcheck import HealthcheckConfig, Verdict, check
from pdserve.testing.waiting import wait_until

PY = sys.executable
SLEEPER = (PY, "-c", "import time; print('up', flush=True); time.sleep(60)")
STUBBORN = (PY, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                      "signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True); time.sleep(60)")
# Prints its grandchild's pid, then sleeps: the grandchild must die with it.
PARENT = (PY, "-c", "import subprocess, sys, time; "
                    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                    "print('grandchild', p.pid, flush=True); time.sleep(60)")
EXITER = (PY, "-c", "import sys; print('line one'); print('fatal: no model', flush=True); sys.exit(3)")

FAKE_ROUTER = '''
import sys, time
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc

class Gen(pdserve_pb2_grpc.GenerationServicer):
    def Health(self, request, context):
        return pdserve_pb2.HealthResponse(serving=True, prefill_nodes=int(sys.argv[2]),
                                          decode_nodes=int(sys.argv[3]))

class Prefill(node_pb2_grpc.PrefillNodeServicer):  # answers node probes too
    def GetStats(self, request, context):
        return node_pb2.NodeStats(kind="prefill", num_blocks=64, used_blocks=3)

server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
pdserve_pb2_grpc.add_GenerationServicer_to_server(Gen(), server)
node_pb2_grpc.add_PrefillNodeServicer_to_server(Prefill(), server)
standard = health.HealthServicer()  # what the probe asks first
for name in ("pdserve.v1.Generation", "pdserve.node.v1.PrefillNode"):
    standard.set(name, health_pb2.HealthCheckResponse.SERVING)
health_pb2_grpc.add_HealthServicer_to_server(standard, server)
server.add_insecure_port(sys.argv[1])
server.start()
print("fake router up", flush=True)
time.sleep(60)
'''


def _alive(pid: int) -> bool:
    """Running, not merely an unreaped zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _all_dead(pids, timeout_s: float = 5.0) -> bool:
    """True once none of `pids` runs (a SIGKILLed grandchild dies a moment after the signal)."""
    pids = list(pids)
    wait_until(lambda: not any(_alive(pid) for pid in pids),
               lambda: f"none of {pids} runs (left: {[pid for pid in pids if _alive(pid)]})", timeout_s)
    return True


def _wait_for_line(supervisor: ClusterSupervisor, name: str, prefix: str, timeout_s: float = 20.0) -> str:
    return wait_until(lambda: next((line for line in supervisor.tail(name) if line.startswith(prefix)), None),
                      lambda: f"{name} prints {prefix!r}: {supervisor.tail(name)}", timeout_s, interval_s=0.05)


@pytest.fixture
def supervisor():
    console = io.StringIO()
    sup = ClusterSupervisor(console=console)
    sup.console_text = console  # for assertions
    try:
        yield sup
    finally:
        pids = list(sup.pids.values())
        sup.stop_all(grace_s=1.0)
        assert _all_dead(pids), "children left alive"


def _free_port() -> int:
    return resolve_port("127.0.0.1", 0)


# ---- command lines -------------------------------------------------------------------


def test_plan_starts_router_then_each_pool_with_its_own_flags():
    config = ClusterConfig(num_prefill=2, num_decode=1, block_size=8, threads_per_node=1,
                           prefill_args=("--max-num-batched-tokens", "1024"),
                           decode_args=("--max-num-seqs", "128"))
    ports = iter(range(6001, 6100))
    plan = build_plan(config, "/m", 50999, python="py", pick_port=lambda: next(ports))
    assert plan.router_addr == "127.0.0.1:50999"
    assert plan.router.argv == ("py", "-m", "pdserve", "router", "--host", "127.0.0.1",
                                "--port", "50999", "--model", "/m", "--block-size", "8", "--http-port", "8000",
                                "--drain-timeout-s", "25")
    assert plan.http_url("127.0.0.1") == "http://127.0.0.1:8000/v1"
    # Each node gets its own port up front: it keeps its address when it is restarted.
    assert plan.addresses == {"prefill-0": "127.0.0.1:6001", "prefill-1": "127.0.0.1:6002",
                              "decode-0": "127.0.0.1:6003"}
    assert [n.name for n in plan.nodes] == ["prefill-0", "prefill-1", "decode-0"]
    prefill = plan.nodes[0].argv
    assert prefill[:4] == ("py", "-m", "pdserve", "prefill")
    flags = dict(zip(prefill[4::2], prefill[5::2]))
    assert flags == {"--model": "/m", "--host": "127.0.0.1", "--port": "6001", "--router": "127.0.0.1:50999",
                     "--node-id": "prefill-0", "--kv-host": "127.0.0.1", "--kv-port": "0",
                     "--dtype": "auto", "--block-size": "8", "--drain-timeout-s": "25", "--num-threads": "1",
                     "--max-num-batched-tokens": "1024"}
    assert plan.nodes[2].argv[3] == "decode"
    assert plan.nodes[2].argv[-2:] == ("--max-num-seqs", "128")
    assert "--max-num-batched-tokens" not in plan.nodes[2].argv


def test_metrics_ports_for_the_router_and_every_node_when_asked():
    ports = iter(range(7001, 7100))
    config = ClusterConfig(num_prefill=1, num_decode=2, metrics_port=9100)
    plan = build_plan(config, "/m", 50999, python="py", pick_port=lambda: next(ports))
    assert plan.metrics_ports == {"router": 9100, "prefill-0": 7001, "decode-0": 7002, "decode-1": 7003}
    assert plan.router.argv[-4:-2] == ("--metrics-port", "9100")
    decode_1 = dict(zip(plan.nodes[2].argv[4::2], plan.nodes[2].argv[5::2]))
    assert (decode_1["--port"], decode_1["--metrics-port"]) == ("7006", "7003")
    assert plan.metrics_urls("127.0.0.1")["decode-1"] == "http://127.0.0.1:7003/metrics"
    assert "--metrics-port" not in build_plan(ClusterConfig(), "/m", 1, python="py").router.argv
    with pytest.raises(ValueError, match="--decode-args must not set --metrics-port"):
        ClusterConfig(decode_args=("--metrics-port", "1"))


def test_a_node_moved_to_the_other_pool_takes_the_leaving_ones_cores_under_a_new_name_and_port():
    ports = iter(range(7001, 7100))
    config = ClusterConfig(num_prefill=1, num_decode=2, metrics_port=9100, decode_cores=(0, 1),
                           prefill_args=("--max-num-seqs", "8"))
    plan = build_plan(config, "/m", 50999, python="py", pick_port=lambda: next(ports), usable_cpus={0, 1})
    leaving = plan.nodes[2]
    joined = node_spec(config, NodeSite("/m", plan.router_addr, "py"), "prefill", "prefill-1", leaving.cpus, 7501,
                       7502)
    moved = plan.with_node_replaced("decode-1", joined, "127.0.0.1", 7502)
    assert [n.name for n in moved.nodes] == ["prefill-0", "decode-0", "prefill-1"]
    assert joined.cpus == leaving.cpus == (1,) and joined.argv[3] == "prefill"
    assert joined.argv[-2:] == ("--max-num-seqs", "8")  # the prefill pool's own flags
    assert moved.addresses["prefill-1"] == "127.0.0.1:7501" and "decode-1" not in moved.addresses
    assert moved.metrics_ports == {"router": 9100, "prefill-0": 7001, "decode-0": 7002, "prefill-1": 7502}


def test_pool_args_are_one_quoted_string_each():
    config = config_from_args(["--prefill", "1", "--decode", "2", "--prefill-args", "--max-num-batched-tokens 1024",
                               "--decode-args", "--max-num-seqs 128 --num-blocks 4096"])
    assert (config.num_prefill, config.num_decode) == (1, 2)
    assert config.prefill_args == ("--max-num-batched-tokens", "1024")
    assert config.decode_args == ("--max-num-seqs", "128", "--num-blocks", "4096")


def test_a_pool_arg_of_one_flag_is_taken_as_that_pools_flag():
    """The README's `--decode-args "--local-prefill"`: argparse alone reads the lone `--local-prefill`
    as a flag of the launcher's and refuses the line."""
    config = config_from_args(["--decode-args", "--local-prefill", "--router-args", "--disaggregation=never",
                               "--prefill-args=--max-num-seqs 8", "--colocated-args", ""])
    assert config.decode_args == ("--local-prefill",)
    assert config.router_args == ("--disaggregation=never",)
    assert config.prefill_args == ("--max-num-seqs", "8")
    assert config.colocated_args == ()


def test_threads_split_the_cores_unless_the_pool_sets_them(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    plan = build_plan(ClusterConfig(num_prefill=1, num_decode=3, decode_args=("--threads=2",)), "/m", 1)
    assert plan.nodes[0].argv[-2:] == ("--num-threads", "2")  # 8 cores / 4 nodes
    assert plan.nodes[1].argv.count("--num-threads") == 0 and plan.nodes[1].argv[-1] == "--threads=2"


@pytest.mark.parametrize("kwargs, message", [
    (dict(prefill_args=("--port", "9")), "--prefill-args must not set --port"),
    (dict(decode_args=("--block-size=32",)), "--decode-args must not set --block-size"),
    (dict(router_args=("--model", "x")), "--router-args must not set --model"),
    (dict(host="0.0.0.0"), "concrete host"),
    (dict(num_decode=0), "at least 1 prefill and 1 decode"),
    (dict(num_prefill=0), "or --prefill 0 with --decode-args --serve-prefill"),
    (dict(num_prefill=1, num_decode=2, decode_args=("--serve-prefill",), rebalance=LoadModeSettings(ttft_slo=1.0)),
     "are both already"),
    (dict(ready_timeout_s=0), "ready_timeout_s must be > 0"),
])
def test_config_rejects_what_would_break_the_cluster(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**kwargs)


def test_decode_nodes_that_serve_prefill_are_the_prefill_pool_too():
    config = config_from_args(["--prefill", "0", "--decode", "2", "--decode-args", "--serve-prefill"])
    assert (config.num_prefill, config.num_decode, config.min_prefill) == (0, 2, 0)
    assert config.node_counts == "2 decode"
    plan = build_plan(config, "/m", 50999, python="py", pick_port=lambda: 6001)
    assert [n.name for n in plan.nodes] == ["decode-0", "decode-1"] and plan.nodes[0].argv[-1] == "--serve-prefill"


def _flags(argv: tuple[str, ...]) -> dict[str, str]:
    return dict(zip(argv[4::2], argv[5::2]))


def test_colocated_plan_starts_only_colocated_nodes_without_kv_listeners():
    config = config_from_args(["--colocated", "2", "--block-size", "8", "--threads-per-node", "1",
                               "--colocated-args", "--max-num-seqs 32"])
    assert (config.num_prefill, config.num_decode, config.num_colocated) == (0, 0, 2)
    assert config.node_counts == "2 colocated"
    plan = build_plan(config, "/m", 50999, python="py", pick_port=lambda: 6001)
    assert [n.name for n in plan.nodes] == ["colocated-0", "colocated-1"]
    argv = plan.nodes[1].argv
    assert argv[:4] == ("py", "-m", "pdserve", "colocated")
    assert _flags(argv) == {"--model": "/m", "--host": "127.0.0.1", "--port": "6001", "--router": "127.0.0.1:50999",
                            "--node-id": "colocated-1", "--dtype": "auto", "--block-size": "8",
                            "--drain-timeout-s": "25", "--num-threads": "1", "--max-num-seqs": "32"}
    assert plan.router.cpus is None and all(n.cpus is None for n in plan.nodes)


@pytest.mark.parametrize("argv, message", [
    (["--colocated", "2", "--prefill", "1"], "do not combine it with prefill or decode nodes"),
    (["--colocated", "-1"], "--colocated must be >= 0"),
    (["--colocated", "1", "--colocated-args", "--cpus 3"], "--colocated-args must not set --cpus"),
    (["--prefill", "2", "--prefill-cores", "0"], "--prefill-cores: 1 cores (0) for 2 nodes"),
    (["--colocated", "1", "--decode-cores", "0"], "--decode-cores given, but the cluster has no decode nodes"),
])
def test_colocated_and_core_flags_are_checked(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        config_from_args(argv)


def test_each_pools_cores_are_split_across_its_nodes_and_set_their_threads():
    config = config_from_args(["--prefill", "2", "--decode", "1", "--prefill-cores", "0-4", "--decode-cores", "6,7",
                               "--router-cores", "5"])
    plan = build_plan(config, "/m", 1, python="py", usable_cpus=range(8))
    assert plan.router.cpus == (5,)
    assert [(n.name, n.cpus) for n in plan.nodes] == [("prefill-0", (0, 1, 2)), ("prefill-1", (3, 4)),
                                                      ("decode-0", (6, 7))]
    for node in plan.nodes:  # a pinned node runs one torch thread per core: no --threads
        assert _flags(node.argv)["--cpus"] == {"prefill-0": "0-2", "prefill-1": "3-4", "decode-0": "6-7"}[node.name]
        assert "--num-threads" not in node.argv
    pinned_threads = build_plan(ClusterConfig(prefill_cores=(0, 1), threads_per_node=1), "/m", 1, usable_cpus={0, 1})
    assert _flags(pinned_threads.nodes[0].argv)["--num-threads"] == "1"  # asked for explicitly
    assert "--cpus" not in pinned_threads.nodes[1].argv  # the decode pool is not pinned


def test_cores_not_on_this_machine_are_refused_naming_the_flag():
    config = ClusterConfig(num_prefill=0, num_decode=0, num_colocated=2, colocated_cores=(0, 1, 2, 3))
    with pytest.raises(ValueError, match=r"^--colocated-cores: core 2-3 is not on this machine"):
        build_plan(config, "/m", 1, usable_cpus={0, 1})
    with pytest.raises(ValueError, match=r"^--router-cores: core 9"):
        build_plan(ClusterConfig(router_cores=(9,)), "/m", 1, usable_cpus={0, 1})


def test_the_ready_banner_names_the_colocated_nodes_and_the_pinning(supervisor):
    stop = threading.Event()
    out = io.StringIO()

    def stop_once_ready() -> None:  # the launcher serves until told to stop: once its banner is out
        wait_until(lambda: "stop with Ctrl-C" in out.getvalue(), lambda: out.getvalue(), 20.0, interval_s=0.01)
        stop.set()

    config = ClusterConfig(num_prefill=0, num_decode=0, num_colocated=2, colocated_cores=(0, 1), router_cores=(0,),
                           ready_timeout_s=20.0, stop_grace_s=2.0, poll_interval_s=0.05)
    plan = build_plan(config, "/m", 1, usable_cpus={0, 1})
    plan = ClusterPlan(ChildSpec("router", SLEEPER, cpus=(0,)),
                       tuple(ChildSpec(n.name, SLEEPER, cpus=n.cpus) for n in plan.nodes), "127.0.0.1:1")
    threading.Thread(target=stop_once_ready, daemon=True).start()
    assert run_cluster(config, plan, supervisor, lambda: Verdict(True, "serving"), stop, out) == 0
    assert "pdserve cluster ready at 127.0.0.1:1 (2 colocated)\n" in out.getvalue()
    assert "pinned: router on cpus 0, colocated-0 on cpus 0, colocated-1 on cpus 1\n" in out.getvalue()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_supervisor_pins_a_child_with_cpus(supervisor):
    core = min(os.sched_getaffinity(0))
    pid = supervisor.start(ChildSpec("pinned", (PY, "-c", "import os, time; print('cpus', sorted("
                                                          "os.sched_getaffinity(0)), flush=True); time.sleep(60)"),
                                     cpus=(core,)))
    assert _wait_for_line(supervisor, "pinned", "cpus") == f"cpus [{core}]"
    assert os.sched_getaffinity(pid) == {core}


def test_resolve_port_picks_a_free_port_and_refuses_a_busy_one():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        busy = listener.getsockname()[1]
        with pytest.raises(ClusterError, match="--port 0"):
            resolve_port("127.0.0.1", busy)
    assert resolve_port("127.0.0.1", 0) > 0


def test_a_picked_port_lies_below_the_ports_the_os_hands_out_itself():
    """A port the OS gives a connection or a port-0 listener meanwhile can never be the one a
    child was told to bind; a taken candidate is passed over."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picks = {resolve_port("127.0.0.1", 0, random.Random(seed)) for seed in range(20)}
    assert all(PICK_LOW <= port < low for port in picks)
    first = resolve_port("127.0.0.1", 0, random.Random(7))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", first))
        listener.listen()
        assert resolve_port("127.0.0.1", 0, random.Random(7)) not in (first, 0)


def test_cli_hands_the_rest_of_argv_to_the_cluster_module(capsys):
    assert cli.main(["cluster", "--prefill", "0"]) == 2  # rejected before anything starts
    assert "at least 1 prefill" in capsys.readouterr().err


# ---- the supervisor ------------------------------------------------------------------


def test_stop_all_ends_every_child_and_its_descendants(supervisor):
    supervisor.start(ChildSpec("a", SLEEPER))
    supervisor.start(ChildSpec("b", PARENT))
    grandchild = int(_wait_for_line(supervisor, "b", "grandchild").split()[1])
    _wait_for_line(supervisor, "a", "up")
    pids = supervisor.pids
    assert supervisor.first_exit() is None
    supervisor.stop_all(grace_s=5.0)
    assert _all_dead([*pids.values(), grandchild])
    assert "[a] up" in supervisor.console_text.getvalue()


def test_a_child_that_ignores_the_stop_signal_is_killed_after_the_grace_period(supervisor):
    supervisor.start(ChildSpec("stubborn", STUBBORN))
    _wait_for_line(supervisor, "stubborn", "up")
    supervisor.stop_all(grace_s=0.5)
    # It ignored SIGINT (and SIGTERM), so what ended it is the SIGKILL after the grace period.
    assert supervisor.returncode("stubborn") == -signal.SIGKILL
    assert not _alive(supervisor.pids["stubborn"])


def test_an_early_exit_is_reported_with_its_last_lines(supervisor):
    supervisor.start(ChildSpec("ok", SLEEPER))
    supervisor.start(ChildSpec("bad", EXITER))
    exited = wait_until(supervisor.first_exit, "a child exits", timeout_s=20, interval_s=0.05)
    assert exited is not None and exited.name == "bad" and exited.returncode == 3
    assert exited.tail == ["line one", "fatal: no model"]
    with pytest.raises(ChildExited, match="bad exited with code 3"):
        supervisor.raise_if_exited()


def test_log_dir_gets_one_file_per_child(tmp_path):
    sup = ClusterSupervisor(log_dir=tmp_path / "logs")
    try:
        sup.start(ChildSpec("bad", EXITER))
        wait_until(lambda: sup.first_exit() is not None, "the child exits", timeout_s=20, interval_s=0.05)  # drains the pipe
    finally:
        sup.stop_all(grace_s=0.0)
    assert (tmp_path / "logs" / "bad.log").read_text() == "line one\nfatal: no model\n"


# ---- the launcher's lifecycle --------------------------------------------------------


def _plan(nodes: list[ChildSpec], router: tuple[str, ...] = SLEEPER) -> ClusterPlan:
    return ClusterPlan(ChildSpec("router", router), tuple(nodes), "127.0.0.1:1")


FAST = ClusterConfig(ready_timeout_s=20.0, stop_grace_s=2.0, poll_interval_s=0.05)


def test_ready_then_stopped_by_signal_stops_every_child(supervisor):
    stop = threading.Event()
    probes = iter([Verdict(False, "down", reachable=False)] + [Verdict(False, "no nodes")] * 2)
    out = io.StringIO()

    def probe() -> Verdict:
        verdict = next(probes, Verdict(True, "serving"))
        if verdict.healthy:
            threading.Timer(0.3, stop.set).start()  # what SIGINT does in main()
        return verdict

    plan = _plan([ChildSpec("prefill-0", SLEEPER), ChildSpec("decode-0", SLEEPER)])
    assert run_cluster(FAST, plan, supervisor, probe, stop, out) == 0
    assert "pdserve cluster ready at 127.0.0.1:1 (1 prefill, 1 decode)" in out.getvalue()
    assert "pdserve generate --addr 127.0.0.1:1" in out.getvalue()
    assert set(supervisor.pids) == {"router", "prefill-0", "decode-0"}
    assert _all_dead(supervisor.pids.values())


def test_nodes_start_beside_the_router_and_a_router_that_never_answers_times_out_naming_it(supervisor):
    seen: list[set[str]] = []

    def probe() -> Verdict:
        seen.append(set(supervisor.pids))
        return Verdict(False, "router at 127.0.0.1:1: UNAVAILABLE", reachable=False)

    config = ClusterConfig(ready_timeout_s=0.5, stop_grace_s=2.0, poll_interval_s=0.05)
    out = io.StringIO()
    assert run_cluster(config, _plan([ChildSpec("decode-0", SLEEPER)]), supervisor, probe,
                       threading.Event(), out) == 1
    assert seen and all(names == {"router", "decode-0"} for names in seen)
    assert ("timed out after 0.5s waiting for the cluster to serve (router at 127.0.0.1:1: UNAVAILABLE)"
            in out.getvalue())
    assert _all_dead(supervisor.pids.values())


def test_a_node_dying_before_ready_fails_the_launch_with_its_log(supervisor):
    out = io.StringIO()
    plan = _plan([ChildSpec("prefill-0", SLEEPER), ChildSpec("decode-0", EXITER)])
    code = run_cluster(FAST, plan, supervisor, lambda: Verdict(False, "no nodes"), threading.Event(), out)
    assert code == 1
    assert "pdserve cluster failed: decode-0 exited with code 3" in out.getvalue()
    assert "  | fatal: no model" in out.getvalue()
    assert _all_dead(supervisor.pids.values())


def test_a_node_dying_while_serving_stops_the_cluster_when_restarts_are_off(supervisor):
    out = io.StringIO()
    plan = _plan([ChildSpec("decode-0", (PY, "-c", "import time, sys; time.sleep(1); sys.exit(5)"))])
    config = dataclasses.replace(FAST, restart=RestartPolicy(mode="never"))
    code = run_cluster(config, plan, supervisor, lambda: Verdict(True, "ok"), threading.Event(), out)
    assert code == 1
    assert "ready at" in out.getvalue() and "decode-0 exited with code 5" in out.getvalue()


def _stop_when(out: io.StringIO, text: str, stop: threading.Event, timeout_s: float = 30.0) -> threading.Thread:
    """Set `stop` once `text` is in `out` (or after `timeout_s`, which fails the test's assertions)."""
    def watch() -> None:
        try:
            wait_until(lambda: text in out.getvalue(), f"{text!r} is printed", timeout_s)
        finally:
            stop.set()  # also on the timeout: the launcher stops and the test's assertions fail

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


QUICK_RESTARTS = RestartPolicy(backoff_s=0.05, max_backoff_s=0.1, max_restarts=2, window_s=60.0)


def test_a_crashing_node_is_restarted_then_given_up_while_the_cluster_serves_on(supervisor):
    out, stop = io.StringIO(), threading.Event()
    crasher = (PY, "-c", "import sys; print('crashing', flush=True); sys.exit(7)")
    plan = _plan([ChildSpec("prefill-0", SLEEPER), ChildSpec("decode-0", crasher)])
    config = dataclasses.replace(FAST, restart=QUICK_RESTARTS)
    watcher = _stop_when(out, "giving up on decode-0", stop)
    assert run_cluster(config, plan, supervisor, lambda: Verdict(True, "ok"), stop, out) == 0
    watcher.join()
    text = out.getvalue()
    assert text.count("decode-0 exited with code 7; starting it again in") == 2
    assert "decode-0 started again (restart 2)" in text
    assert "giving up on decode-0: decode-0 exited with code 7 after 2 restarts in 60s; serving on without it" in text
    assert "  | crashing" in text
    assert "prefill-0" not in text  # untouched
    assert _all_dead(supervisor.pids.values())


@pytest.mark.parametrize("mode", ["on-failure", "always"])
def test_a_refused_or_misused_child_is_never_restarted(mode):
    policy = RestartPolicy(mode=mode)
    assert [policy.wants(code) for code in (1, 2, 78, -9)] == [True, False, False, True]
    assert [policy.final(code) for code in (1, 2, 78)] == [False, True, True]
    assert not RestartPolicy(mode="never").final(78)  # `never` stops the cluster on any exit


def test_a_node_the_router_refused_is_given_up_at_once_while_the_cluster_serves_on(supervisor):
    out, stop = io.StringIO(), threading.Event()
    refused = (PY, "-c", "import sys; print('pdserve decode: the router refused this node: block_size: this node "
                         "has 16, the router 8', flush=True); sys.exit(78)")
    plan = _plan([ChildSpec("prefill-0", SLEEPER), ChildSpec("decode-0", refused)])
    config = dataclasses.replace(FAST, restart=QUICK_RESTARTS)
    watcher = _stop_when(out, "giving up on decode-0", stop)
    assert run_cluster(config, plan, supervisor, lambda: Verdict(True, "ok"), stop, out) == 0
    watcher.join()
    text = out.getvalue()
    assert ("pdserve cluster: giving up on decode-0: decode-0 exited with code 78, which restarting cannot help; "
            "serving on without it") in text
    assert "  | pdserve decode: the router refused this node: block_size: this node has 16, the router 8" in text
    assert "started again" not in text and "starting it again" not in text
    assert _all_dead(supervisor.pids.values())


def test_a_killed_node_comes_back_on_the_same_command_line_and_the_state_file_follows(supervisor, tmp_path):
    out, stop = io.StringIO(), threading.Event()
    state_file = tmp_path / "state.json"
    plan = ClusterPlan(ChildSpec("router", SLEEPER), (ChildSpec("decode-0", SLEEPER),), "127.0.0.1:1",
                       {"decode-0": "127.0.0.1:2"})
    config = dataclasses.replace(FAST, restart=QUICK_RESTARTS, state_file=str(state_file))
    first = {}

    def kill_then_watch() -> None:
        wait_until(lambda: read_state(state_file) is not None, "the state file is written", timeout_s=30)
        first.update(read_state(state_file).children)
        os.killpg(first["decode-0"].pid, signal.SIGKILL)  # what a crash of the machine's node does
        _stop_when(out, "decode-0 started again (restart 1)", stop).join()

    killer = threading.Thread(target=kill_then_watch, daemon=True)
    killer.start()
    assert run_cluster(config, plan, supervisor, lambda: Verdict(True, "ok"), stop, out) == 0
    killer.join()
    state = read_state(state_file)
    assert state.router == "127.0.0.1:1" and state.addresses("decode") == ["127.0.0.1:2"]
    assert state.children["decode-0"].restarts == 1 and state.children["decode-0"].pid != first["decode-0"].pid
    assert first["router"].pid == state.children["router"].pid
    assert "decode-0 exited with code -9; starting it again in 0.05s" in out.getvalue()
    assert _all_dead(supervisor.pids.values())


def test_a_crash_looping_router_stops_the_cluster(supervisor, tmp_path):
    # The router lives until the cluster is ready (the probe's answer, "serving", leaves the mark),
    # then every start of it exits 3 at once: a crash loop after the start, however slowly a
    # loaded machine starts the children.
    mark = tmp_path / "ready"
    router = (PY, "-c", f"import os, sys, time\nwhile not os.path.exists({str(mark)!r}): time.sleep(0.01)\nsys.exit(3)")

    def probe() -> Verdict:
        mark.touch()
        return Verdict(True, "ok")

    out = io.StringIO()
    config = dataclasses.replace(FAST, restart=dataclasses.replace(QUICK_RESTARTS, max_restarts=1))
    code = run_cluster(config, _plan([ChildSpec("decode-0", SLEEPER)], router=router), supervisor,
                       probe, threading.Event(), out)
    assert code == 1
    assert "router exited with code 3 after 1 restarts in 60s; stopping the cluster" in out.getvalue()
    assert _all_dead(supervisor.pids.values())


def test_launcher_with_a_real_health_probe(supervisor, tmp_path):
    script = tmp_path / "fake_router.py"
    script.write_text(FAKE_ROUTER)
    addr = f"127.0.0.1:{_free_port()}"
    plan = ClusterPlan(ChildSpec("router", (PY, str(script), addr, "1", "2")),
                       (ChildSpec("decode-0", SLEEPER),), addr)
    config = ClusterConfig(num_decode=2, ready_timeout_s=60.0, stop_grace_s=2.0, poll_interval_s=0.1)
    probe_config = HealthcheckConfig(timeout_s=1.0, min_prefill=1, min_decode=2)
    stop = threading.Event()
    out = io.StringIO()

    stricter: list[Verdict] = []

    def probe() -> Verdict:
        verdict = check(addr, "router", probe_config)
        if verdict.healthy:  # the cluster is ready: probe it more strictly, then stop it
            stricter.append(check(addr, "router", HealthcheckConfig(min_decode=3)))
            stricter.append(check(addr, "prefill"))
            stricter.append(check(addr, "decode"))
            stop.set()
        return verdict

    assert run_cluster(config, plan, supervisor, probe, stop, out) == 0
    assert f"ready at {addr} (1 prefill, 2 decode)" in out.getvalue()
    too_few, prefill, decode = stricter
    assert not too_few.healthy and "too few nodes (1 prefill, 2 decode" in too_few.reason
    assert prefill.healthy and "3/64 blocks used" in prefill.reason
    assert not decode.healthy and decode.reachable and "NOT_FOUND" in decode.reason  # no decode service there
    assert check(addr, "router", probe_config).reachable is False  # stopped with the cluster


def test_healthcheck_names_an_unreachable_router():
    verdict = check(f"127.0.0.1:{_free_port()}", "router", HealthcheckConfig(timeout_s=0.5))
    assert not verdict.healthy and not verdict.reachable
    assert "UNAVAILABLE" in verdict.reason or "DEADLINE_EXCEEDED" in verdict.reason


# ---- drains: SIGTERM, what Kubernetes sends ----------------------------------------------

def _drainer(log: Path, name: str) -> tuple[str, ...]:
    """A child that, on SIGTERM, notes its name in `log` and exits 0 (a drained server)."""
    code = ("import signal, sys, time\n"
            "def term(*_):\n"
            f"    open({str(log)!r}, 'a').write({name!r} + '\\n'); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, term)\n"
            "print('up', flush=True)\n"
            "time.sleep(60)\n")
    return (PY, "-c", code)


def test_a_node_that_drains_and_exits_0_leaves_while_the_cluster_serves_on(supervisor):
    out, stop = io.StringIO(), threading.Event()
    leaver = (PY, "-c", "import time, sys; time.sleep(0.5); sys.exit(0)")
    plan = _plan([ChildSpec("prefill-0", SLEEPER), ChildSpec("decode-0", leaver), ChildSpec("decode-1", SLEEPER)])
    watcher = _stop_when(out, "decode-0 drained and left", stop)
    assert run_cluster(FAST, plan, supervisor, lambda: Verdict(True, "ok"), stop, out) == 0
    watcher.join()
    text = out.getvalue()
    assert "pdserve cluster: decode-0 drained and left the cluster; serving on without it" in text
    assert "failed" not in text and "started again" not in text


def test_a_sigterm_drains_the_router_first_then_every_node_and_exits_0(supervisor, tmp_path):
    out, stop, log = io.StringIO(), threading.Event(), tmp_path / "terms"
    plan = _plan([ChildSpec("prefill-0", _drainer(log, "prefill-0")), ChildSpec("decode-0", _drainer(log, "decode-0"))],
                 router=_drainer(log, "router"))
    def sigterm_once_up() -> None:  # what main()'s handler does on SIGTERM: `stop`, and drain_asked() says so
        try:
            wait_until(lambda: "ready at" in out.getvalue(), "the cluster is ready", 30.0)
            for name in ("router", "prefill-0", "decode-0"):
                _wait_for_line(supervisor, name, "up")  # its SIGTERM handler is in place
        finally:
            stop.set()

    watcher = threading.Thread(target=sigterm_once_up, daemon=True)
    watcher.start()
    assert run_cluster(FAST, plan, supervisor, lambda: Verdict(True, "ok"), stop, out, drain_asked=lambda: True) == 0
    watcher.join()
    lines = log.read_text().split()
    assert lines[0] == "router" and sorted(lines[1:]) == ["decode-0", "prefill-0"]
    assert all(supervisor.returncode(name) == 0 for name in ("router", "prefill-0", "decode-0"))
    assert "pdserve cluster: draining" in out.getvalue()


def test_a_router_that_drained_stops_the_cluster_draining_its_nodes(supervisor, tmp_path):
    out, log = io.StringIO(), tmp_path / "terms"
    router = (PY, "-c", "import time, sys; time.sleep(0.5); sys.exit(0)")
    plan = _plan([ChildSpec("decode-0", _drainer(log, "decode-0"))], router=router)
    assert run_cluster(FAST, plan, supervisor, lambda: Verdict(True, "ok"), threading.Event(), out) == 0
    assert "the router drained and stopped; draining the nodes and stopping the cluster" in out.getvalue()
    assert log.read_text().split() == ["decode-0"] and supervisor.returncode("decode-0") == 0

"""The clean edges of every command, run as users run them (`python -m pdserve ...` processes).

- Ctrl-C (SIGINT to the command's process group, as a terminal sends it) ends `pdserve
  generate` mid-stream, `pdserve router`, every node kind, `pdserve demo`, `pdserve bench
  serve` and `pdserve cluster` (with every child) with exit status 130 and no traceback.
- A port something else listens on is one line naming the flag and the address, exit
  status 2, for every port of every command: `--port`, `--metrics-port`, `--kv-port`.
- `/health` on the metrics port: 200 saying what serves, for a node; 503 with the reason
  for a router that has no node yet, and once a node's engine core is dead.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pdserve.cluster_process import POLL_S
from pdserve.cluster_state import read_state
from tests.e2e.cluster import START_TIMEOUT_S, free_port, running_cluster
from pdserve.testing.waiting import wait_until

HOST = "127.0.0.1"
STOP_TIMEOUT_S = 60.0
NODE_FLAGS = ("--dtype", "float32", "--num-blocks", "64", "--max-num-batched-tokens", "64")


def _as_a_terminal_starts_it() -> None:
    """Ctrl-C as a shell at a terminal leaves it: a suite started in the background (`cmd &` in a
    script) passes SIGINT on ignored, and a Python started so never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Command:
    """`python -m pdserve ARGS` in its own process group, its output collected as it comes."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve", *args], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                     preexec_fn=_as_a_terminal_starts_it)
        self._changed = threading.Condition()
        self._text = {"stdout": "", "stderr": ""}
        self._ended: set[str] = set()
        self._readers = [threading.Thread(target=self._pump, args=(name, stream), daemon=True)
                         for name, stream in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr))]
        for reader in self._readers:
            reader.start()

    def __enter__(self) -> Command:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:  # a test that failed early: Ctrl-C first, so a launcher stops its children
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    @property
    def stdout(self) -> str:
        return self._text["stdout"]

    @property
    def stderr(self) -> str:
        return self._text["stderr"]

    def wait_for(self, text: str, stream: str = "stdout", timeout_s: float = START_TIMEOUT_S) -> None:
        """Until `text` shows on `stream` (`""`: any output at all); fails if the stream ends first."""
        with self._changed:
            self._changed.wait_for(lambda: (text in self._text[stream] if text else self._text[stream])
                                   or stream in self._ended, timeout_s)
        if text not in self._text[stream] or not self._text[stream]:
            raise AssertionError(f"{self.proc.args[3:]} never wrote {text!r} on {stream} "
                                 f"(exit code {self.proc.poll()}):\n{self.stdout[-3000:]}\n{self.stderr[-3000:]}")

    def interrupt(self) -> int:
        """Ctrl-C: SIGINT to the whole process group; returns the exit code."""
        os.killpg(self.proc.pid, signal.SIGINT)
        return self.wait()

    def wait(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        code = self.proc.wait(timeout_s)
        for reader in self._readers:
            reader.join(timeout_s)
        return code

    def _pump(self, name: str, stream) -> None:
        for chunk in iter(lambda: stream.read1(1 << 16), b""):
            with self._changed:
                self._text[name] += chunk.decode(errors="replace")
                self._changed.notify_all()
        with self._changed:
            self._ended.add(name)
            self._changed.notify_all()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def core_pid(front_pid: int) -> int:
    """A node front's engine-core process (its other child is multiprocessing's resource tracker)."""
    children = Path(f"/proc/{front_pid}/task/{front_pid}/children").read_text().split()
    cores = [int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(cores) == 1, children
    return cores[0]


def line_value(text: str, prefix: str) -> str:
    """The last word of the line starting with `prefix` (an address or a URL)."""
    return next(line for line in text.splitlines() if line.startswith(prefix)).split()[-1]


def health_url(metrics_url: str) -> str:
    return metrics_url.replace("/metrics", "/health")


def assert_interrupted(command: Command, code: int) -> None:
    assert code == 130, f"exit code {code}:\n{command.stdout[-3000:]}\n{command.stderr[-3000:]}"
    assert "Traceback" not in command.stderr and "Traceback" not in command.stdout, command.stderr


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture
def held_port():
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        sock.listen()
        yield sock.getsockname()[1]


# -- a busy port ----------------------------------------------------------------------------

BUSY_PORT_CASES = [
    ("router", "--port"), ("router", "--metrics-port"), ("router", "--http-port"),
    *[(kind, flag) for kind in ("prefill", "decode", "colocated") for flag in ("--port", "--metrics-port")],
    ("prefill", "--kv-port"), ("decode", "--kv-port"),  # UCX's TCP transport, on --kv-host only
    ("cluster", "--port"), ("cluster", "--metrics-port"), ("cluster", "--http-port"),
]


@pytest.mark.parametrize("command, flag", BUSY_PORT_CASES, ids=[f"{command}{flag}" for command, flag in BUSY_PORT_CASES])
def test_a_busy_port_is_one_line_naming_the_flag_and_exit_2(command, flag, held_port, model_dir):
    others = [] if flag == "--port" else ["--port", "0"]
    extra = ["--router", f"{HOST}:{free_port()}", *NODE_FLAGS] if command in ("prefill", "decode", "colocated") else []
    with Command(command, "--model", model_dir, *others, *extra, flag, str(held_port)) as run:
        code = run.wait(START_TIMEOUT_S)
    assert (code, run.stdout) == (2, "")
    assert run.stderr == f"pdserve {command}: {flag} {held_port}: {HOST}:{held_port} is already in use\n"


# -- Ctrl-C and /health of single processes -------------------------------------------------


def test_ctrl_c_stops_a_router_and_its_health_said_why_it_did_not_serve(model_dir):
    with Command("router", "--model", model_dir, "--port", "0", "--metrics-port", "0") as router:
        router.wait_for("pdserve router metrics on ")
        health = get(health_url(line_value(router.stdout, "pdserve router metrics on ")))
        assert health == (503, "not serving: no route for a request yet (0 prefill, 0 decode and 0 colocated nodes "
                               "live): the router serves once a colocated node, or a prefill and a decode node, "
                               "have registered\n")
        assert_interrupted(router, router.interrupt())


@pytest.mark.parametrize("kind", ["prefill", "decode", "colocated"])
def test_ctrl_c_stops_a_node_and_its_engine_core(kind, model_dir):
    with Command(kind, "--model", model_dir, "--port", "0", "--metrics-port", "0", "--router",
                 f"{HOST}:{free_port()}", *NODE_FLAGS) as node:
        node.wait_for(f"pdserve {kind} node listening on ")
        address = line_value(node.stdout, f"pdserve {kind} node listening on ")
        health = get(health_url(line_value(node.stdout, f"pdserve {kind} node metrics on ")))
        assert health == (200, f"serving: {kind} node on {address}, engine core running\n")
        core = core_pid(node.proc.pid)
        assert_interrupted(node, node.interrupt())
        assert not alive(core)


def test_a_node_whose_engine_core_died_answers_503(model_dir):
    with Command("colocated", "--model", model_dir, "--port", "0", "--metrics-port", "0", "--router",
                 f"{HOST}:{free_port()}", *NODE_FLAGS) as node:
        node.wait_for("pdserve colocated node listening on ")
        address = line_value(node.stdout, "pdserve colocated node listening on ")
        metrics = line_value(node.stdout, "pdserve colocated node metrics on ")
        core = core_pid(node.proc.pid)
        # Frozen, the front can neither notice the death nor exit (nor reap the core): the
        # question below is already waiting for it when it goes on.
        os.kill(node.proc.pid, signal.SIGSTOP)
        os.kill(core, signal.SIGKILL)
        wait_until_dead(core)
        host, port = metrics.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=STOP_TIMEOUT_S) as probe:
            probe.sendall(f"GET /health HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            os.kill(node.proc.pid, signal.SIGCONT)
            answer = b"".join(iter(lambda: probe.recv(1 << 16), b"")).decode()
        head, body = answer.split("\r\n\r\n", 1)
        assert head.startswith("HTTP/1.0 503 ")
        assert body == f"not serving: colocated node on {address}: its engine core is down\n"
        assert node.wait() == 1  # a node without its core stops (a launcher starts it again)
        assert "Traceback" not in node.stderr


def wait_until_dead(pid: int) -> None:
    """SIGKILL is sent, the process still has to die: until every thread of it has exited and
    only its exit status is left for its parent (a zombie whose threads are all gone)."""
    wait_until(lambda: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z" and len(
        os.listdir(f"/proc/{pid}/task")) == 1, f"{pid} is a zombie without threads", interval_s=0.0)


def test_ctrl_c_stops_the_demo_mid_generation(model_dir):
    # Four prompts of ~4000 tokens each: Ctrl-C lands thousands of steps before the end.
    with Command("demo", "--model", model_dir, "--dtype", "float32", "--max-tokens", "4000", "a", "b", "c",
                 "d") as demo:
        demo.wait_for("[0] ")
        assert_interrupted(demo, demo.interrupt())


# -- against a running cluster --------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_cluster(model_dir):
    """One colocated node whose every step takes 0.1 s: a stream of 400 tokens lasts 40 s."""
    with running_cluster(model_dir, 0, 0, num_colocated=1, colocated_args=("--debug-step-delay-s", "0.1")) as cluster:
        yield cluster


def test_ctrl_c_ends_generate_mid_stream_and_frees_the_request(slow_cluster):
    with Command("generate", "--addr", slow_cluster.router, "--max-tokens", "400", "--ignore-eos",
                 "The quick brown fox") as generate:
        generate.wait_for("")  # text has arrived: the stream is in flight
        assert_interrupted(generate, generate.interrupt())
        assert generate.stderr == ""
        assert generate.stdout.endswith("\n")
    held = [(s.used_blocks, s.reserved_blocks) for s in slow_cluster.wait_all_blocks_free()]
    assert held == [(0, 0)]


def test_ctrl_c_ends_the_serving_benchmark_mid_run(slow_cluster):
    with Command("bench", "serve", "--addr", slow_cluster.router, "--rate", "inf", "--num-requests", "8",
                 "--workload", "fixed", "--input-len", "8", "--output-len", "200", "--no-progress") as bench:
        wait_until_running(slow_cluster)
        assert_interrupted(bench, bench.interrupt())
    slow_cluster.wait_all_blocks_free()


def wait_until_running(cluster, timeout_s: float = START_TIMEOUT_S) -> None:
    """Until the node runs a request (polled: its stats are the only way to see it)."""
    name = cluster.names("colocated")[0]
    wait_until(lambda: cluster.stats(name).num_running, "a request reaches the node", timeout_s, POLL_S)


def test_ctrl_c_stops_the_cluster_and_every_child(model_dir, tmp_path):
    state_file = tmp_path / "state.json"
    with Command("cluster", "--colocated", "1", "--model", model_dir, "--port", "0", "--http-port", "0", "--state-file", str(state_file),
                 "--dtype", "float32", "--colocated-args", " ".join(NODE_FLAGS[2:])) as launcher:
        launcher.wait_for("stop with Ctrl-C")
        children = wait_for_state(state_file).children
        pids = {name: child.pid for name, child in children.items()}
        cores = {name: core_pid(pid) for name, pid in pids.items() if name != "router"}
        assert set(pids) == {"router", "colocated-0"} and all(alive(pid) for pid in pids.values())
        assert_interrupted(launcher, launcher.interrupt())
    assert [name for name, pid in {**pids, **cores}.items() if alive(pid)] == []


def test_a_launcher_killed_outright_leaves_no_child_behind(model_dir, tmp_path):
    # SIGKILL cannot be caught: the launcher stops nothing. Its children see it gone and stop.
    state_file = tmp_path / "state.json"
    with Command("cluster", "--colocated", "1", "--model", model_dir, "--port", "0", "--http-port", "0", "--state-file", str(state_file),
                 "--dtype", "float32", "--colocated-args", " ".join(NODE_FLAGS[2:])) as launcher:
        launcher.wait_for("stop with Ctrl-C")
        pids = {name: child.pid for name, child in wait_for_state(state_file).children.items()}
        cores = {name: core_pid(pid) for name, pid in pids.items() if name != "router"}
        os.kill(launcher.proc.pid, signal.SIGKILL)  # the launcher alone, not its children's groups
        launcher.proc.wait()
        def left() -> list[str]:
            return [name for name, pid in {**pids, **cores}.items() if alive(pid)]

        wait_until(lambda: not left(), lambda: f"no child is left behind: {left()}", 60, POLL_S)


def wait_for_state(path: Path, timeout_s: float = START_TIMEOUT_S):
    """The launcher writes its state file just after its ready banner: until it is there."""
    return wait_until(lambda: read_state(path), f"a state file is at {path}", timeout_s, POLL_S)

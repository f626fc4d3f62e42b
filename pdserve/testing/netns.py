"""Hosts for a test of a cluster across machines: Linux network namespaces joined by a bridge.

`Hosts(names)` makes one namespace per name, each with its own address on a private /24, all
joined by a bridge in this namespace (which gets the .254 address, so this process reaches
every host), and `run` starts a command inside one (`ip netns exec`). Leaving the `with`
block kills what it started (process groups) and deletes the namespaces and the bridge, also
after a failure. `unavailable()` says why namespaces cannot be made here (not root, no `ip`,
no permission), for a test to skip on.

Must never: touch an interface or namespace it did not make, or leave one behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

IP_TIMEOUT_S = 10.0


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"pdprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=IP_TIMEOUT_S)
    return None


class Hosts:
    """Namespaces `names`, host i at 10.<subnet>.<i + 1>; the bridge (this side) at .254."""

    def __init__(self, names: Sequence[str], subnet: str, log_dir: Path) -> None:
        tag = os.getpid() % 100000
        self.subnet = subnet  # "10.231.7": the first three octets
        self.namespaces = {name: f"pd{tag}-{name}" for name in names}
        self.addresses = {name: f"{subnet}.{i + 1}" for i, name in enumerate(names)}
        self._bridge = f"pdbr{tag}"
        self._veths = {name: f"pdv{tag}{i}" for i, name in enumerate(names)}
        self._log_dir = log_dir
        self._procs: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self._procs.values():
            _kill_group(proc)
        # The pair's end here first: a deleted namespace takes its end only once the kernel has
        # let go of it, which sockets of the processes just killed can hold up.
        for veth in self._veths.values():
            _ip("link", "del", veth, check=False)
        for namespace in self.namespaces.values():
            _ip("netns", "del", namespace, check=False)
        _ip("link", "del", self._bridge, check=False)

    def run(self, host: str, name: str, argv: Sequence[str]) -> subprocess.Popen:
        """Start `argv` on `host`, its output in `<log_dir>/<name>.log`, in a process group of its own."""
        with open(self._log_dir / f"{name}.log", "w") as log:
            proc = subprocess.Popen(["ip", "netns", "exec", self.namespaces[host], *argv], stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self._procs[name] = proc
        return proc

    def exited(self) -> list[str]:
        """The names of the commands that have ended."""
        return [name for name, proc in self._procs.items() if proc.poll() is not None]

    def log(self, name: str) -> str:
        path = self._log_dir / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def listeners(self, host: str) -> list[str]:
        """Every TCP listening address (`ADDRESS:PORT`) in `host`'s namespace."""
        out = _ip("netns", "exec", self.namespaces[host], "ss", "-Hltn")
        return [line.split()[3] for line in out.splitlines() if line.strip()]

    def _make(self) -> None:
        _ip("link", "add", self._bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.254/24", "dev", self._bridge)
        _ip("link", "set", self._bridge, "up")
        for host, namespace in self.namespaces.items():
            veth = self._veths[host]
            _ip("netns", "add", namespace)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _ip("link", "set", veth, "master", self._bridge)
            _ip("link", "set", veth, "up")
            inside = ("netns", "exec", namespace, "ip")
            _ip(*inside, "addr", "add", f"{self.addresses[host]}/24", "dev", "eth0")
            _ip(*inside, "link", "set", "eth0", "up")
            _ip(*inside, "link", "set", "lo", "up")


def _ip(*args: str, check: bool = True) -> str:
    argv = ["ip", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()

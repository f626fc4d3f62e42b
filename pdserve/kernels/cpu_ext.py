"""The C++ CPU kernels (pdserve/kernels/csrc: paged attention, cache write, the native model's layer
ops, GEMV and the whole layer stack): built once per machine at first use, then loaded.

Owns compiling and loading the extension and the answer to "is it active?". A process
that is about to compile says so first, once, on stderr (`build_needed`; not when it only
loads an earlier build). The build goes under the pdserve cache dir (`$PDSERVE_CACHE`, else
~/.cache/pdserve), in a folder keyed by the CPU's instruction set (it is compiled with
-march=native: a cache dir shared with another kind of machine gets its own build), the
torch/Python versions and the sources' content. So a folder holds one build of one set of
sources: an edited source builds into a folder of its own, and two checkouts of the same
sources (a clone and an install, a CI clone and a working tree) share one build instead of
rebuilding over each other's. A finished build (its `built` mark, written after it loaded) is
loaded as it is, without torch's build tools or a ninja run.
Processes building at once (a cluster's nodes) take turns on a lock the kernel releases when
its holder dies, so a build killed halfway (Ctrl-C) never leaves the next start waiting forever
on torch's own lock file, which a dead process leaves behind.
If the build fails (no compiler, no ninja, ...) we log one warning and report the
extension unavailable; callers then use their torch paths, which compute the same thing.
`PDSERVE_CPU_EXT=0` forces the torch paths (for comparisons and debugging).

It never decides which kernel runs for which shapes; the kernel modules do.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.common.paths import default_cache_dir

log = logging.getLogger(__name__)

DISABLE_ENV = "PDSERVE_CPU_EXT"
NAME = "pdserve_cpu_kernels"  # the extension, and its library's file name in the build dir
CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))
BUILT_MARK = "built"  # written in the build dir once its library has loaded
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_state: dict[str, CpuOps | None] = {}  # "ops" -> the loaded ops, or None after a failure


@dataclass(frozen=True, slots=True)
class CpuOps:
    """The extension's ops (see pdserve/kernels/csrc/*.cpp for their contracts)."""

    paged_attention: Callable[..., None]
    write_kv_cache: Callable[..., None]
    rms_norm: Callable[..., None]
    add_rms_norm: Callable[..., None]
    rope_write_kv: Callable[..., None]
    linear_gemv: Callable[..., torch.Tensor]
    layer_stack: Callable[..., torch.Tensor]
    # head_dim -> the lanes of the attention's vector loops for it: 16 (AVX-512), 8 (AVX2), 0
    # (its portable loops). Memoised: a build's fact.
    attention_lanes: Callable[[int], int]
    # The CPU multiplies bf16 on AMX tiles: torch's bf16 matmuls (SDPA's among them) run there,
    # the kernel's own loops do not.
    amx_bf16: bool


def available() -> bool:
    """Whether the C++ kernels are active (building them on first call)."""
    return ops() is not None


def ops() -> CpuOps | None:
    """The extension's ops, or None if it is disabled or failed to build (warned once)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    if "ops" not in _state:  # called per layer and step: take the lock only until built
        with _lock:
            if "ops" not in _state:
                _state["ops"] = _build()
    return _state["ops"]


@contextlib.contextmanager
def _builder_turn(build_dir: Path) -> Iterator[None]:
    """This process alone builds or loads in `build_dir` until the block ends. Whoever holds
    the turn is the only one that can be building, so torch's lock file found then was left by
    a build that died; it is removed, or torch would wait on it forever."""
    with open(build_dir / "pdserve-build.lock", "w") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)  # released by the kernel when the holder exits or dies
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def _build() -> CpuOps | None:
    build_dir = _build_dir()
    if build_needed(build_dir):
        # A node's first start is otherwise silent for the minute the compiler takes. On
        # stderr, which is the node's log.
        print(f"pdserve: building C++ kernels (once, about a minute) in {build_dir}", file=sys.stderr, flush=True)
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with _builder_turn(build_dir):
            _load_or_build(build_dir)
        # The overloads themselves: calling them skips the packet's overload resolution.
        namespace = torch.ops.pdserve_cpu
        return CpuOps(
            namespace.paged_attention.default,
            namespace.write_kv_cache.default,
            namespace.rms_norm.default,
            namespace.add_rms_norm.default,
            namespace.rope_write_kv.default,
            namespace.linear_gemv.default,
            namespace.layer_stack.default,
            functools.cache(namespace.attention_lanes.default),
            "amx_bf16" in cpu_flags(),
        )
    except Exception as exc:  # any build or load failure means: use the torch paths
        log.warning("pdserve C++ CPU kernels unavailable, using the torch paths: %s", _summary(exc))
        log.debug("C++ CPU kernels build failure", exc_info=True)
        return None


def _load_or_build(build_dir: Path) -> None:
    """Registers the ops with the dispatcher (TORCH_LIBRARY: no Python module, no pybind),
    from the folder's finished build, else after building it."""
    if not build_needed(build_dir):
        # The folder's key holds the sources' content, so its library is theirs: no ninja run,
        # which would rebuild for a checkout whose paths differ from the builder's.
        torch.ops.load_library(str(build_dir / f"{NAME}.so"))
        return
    # Imported here: importing the kernels package must stay cheap and compiler-free.
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=NAME,
        sources=[str(path) for path in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    (build_dir / BUILT_MARK).touch()  # after the load: a build killed halfway is never marked


def build_needed(build_dir: Path) -> bool:
    """Whether loading the kernels from `build_dir` compiles them first: it holds no finished
    build yet (a build killed halfway left no mark)."""
    return not (build_dir / BUILT_MARK).exists()


def _build_dir() -> Path:
    flags = " ".join(sorted(cpu_flags()))
    key = "|".join([platform.machine(), flags, torch.__version__, sys.version, " ".join(CFLAGS), sources_digest()])
    return default_cache_dir() / "torch_extensions" / f"cpu_kernels-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def sources_digest(csrc: Path = CSRC) -> str:
    """A hash of every file under `csrc` (names and bytes, headers too): the build's sources."""
    digest = hashlib.sha256()
    for path in sorted(p for p in csrc.rglob("*") if p.is_file()):
        digest.update(path.relative_to(csrc).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (x86 "flags", Arm "Features")."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next((ln for ln in cpuinfo if ln.startswith(("flags", "Features"))), "")
    except OSError:
        line = ""
    return set(line.partition(":")[2].split()) if line else set(platform.processor().split())


def _summary(exc: Exception) -> str:
    """The exception's first line and, for a failed build, the compiler's first error line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines[1:] if "error" in line.lower() or "not found" in line.lower()]
    return " | ".join([f"{type(exc).__name__}: {lines[0][:200] if lines else ''}", *errors[:1]])

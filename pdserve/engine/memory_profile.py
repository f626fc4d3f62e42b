"""Measures what the KV budget needs (pdserve/engine/kv_budget.py): the memory still available to this
process, what it holds, and the peak activation memory of the largest step it will schedule.

- Available: the smaller of /proc/meminfo's MemAvailable and the headroom of the process's
  memory cgroup (v2 `memory.max − memory.current`, v1 `memory.limit_in_bytes −
  memory.usage_in_bytes`; no limit, no headroom cap).
- Held: the process's resident set (VmRSS): the weights it loaded and the runtime around them.
- Activations: torch has no allocator statistics on CPU, and tracemalloc does not see its
  buffers, so the peak is read from the kernel: writing 5 to /proc/self/clear_refs resets the
  process's peak resident set (VmHWM) to the current one, a dummy step runs, and VmHWM minus
  the resident set before it is the step's peak. The dummy steps are the largest the scheduler
  can make: one chunk of max_num_batched_tokens at the end of a full-length context (attention
  over the longest context), and max_num_batched_tokens spread over max_num_seqs requests
  (the most sampled rows); the larger peak counts. Their KV goes to a throwaway cache sized for
  them, whose touched pages count as activations (a small overestimate). Where clear_refs cannot
  be written, the resident growth after the steps is used instead (an underestimate), and a
  warning says so.

Must never: size or allocate the engine's own KV cache (the engine core does).
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_budget import MemoryFacts
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.model_loader import LoadedModel
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


def meminfo_available(meminfo: str) -> int:
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError("/proc/meminfo has no MemAvailable line")


def status_bytes(status: str, key: str) -> int:
    """A `VmRSS:`/`VmHWM:` line of /proc/self/status, in bytes."""
    for line in status.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"/proc/self/status has no {key} line")


def cgroup_headroom(proc_cgroup: str, root: Path = CGROUP_ROOT) -> int | None:
    """Bytes the process's memory cgroup still allows, or None without a limit. Looks in the
    cgroup's own folder first, then at the mount's root (a container's namespace root)."""
    for line in proc_cgroup.splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:  # v2
            files = ("memory.max", "memory.current")
            dirs = [root / path.lstrip("/"), root]
        elif "memory" in controllers.split(","):  # v1
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
            dirs = [root / "memory" / path.lstrip("/"), root / "memory"]
        else:
            continue
        for folder in dirs:
            limit_file, usage_file = folder / files[0], folder / files[1]
            if not (limit_file.is_file() and usage_file.is_file()):
                continue
            limit = limit_file.read_text().strip()
            if limit == "max" or int(limit) >= UNLIMITED:
                break  # this hierarchy sets no limit; another may
            return max(0, int(limit) - int(usage_file.read_text()))
    return None


def available_bytes(proc: Path = PROC, root: Path = CGROUP_ROOT) -> int:
    available = meminfo_available((proc / "meminfo").read_text())
    headroom = cgroup_headroom((proc / "self" / "cgroup").read_text(), root)
    return available if headroom is None else min(available, headroom)


def resident_bytes() -> int:
    return status_bytes((PROC / "self" / "status").read_text(), "VmRSS")


def _reset_peak() -> bool:
    try:
        (PROC / "self" / "clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_growth(run) -> int:
    """Bytes the resident set grew to at most while `run()` ran, over what it was before."""
    gc.collect()
    before = resident_bytes()
    exact = _reset_peak()
    run()
    if exact:
        return max(0, status_bytes((PROC / "self" / "status").read_text(), "VmHWM") - before)
    logger.warning("cannot reset the peak resident set (/proc/self/clear_refs): the activation "
                   "estimate is the growth after the dummy step, a lower bound")
    return max(0, resident_bytes() - before)


def dummy_steps(config: EngineConfig, max_model_len: int) -> list[list[tuple[int, int]]]:
    """The largest steps, each as (tokens computed before, tokens scheduled) per request."""
    tokens = min(config.max_num_batched_tokens, max_model_len)
    long_context = [(max_model_len - tokens, tokens)]
    num_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
    per_seq = [config.max_num_batched_tokens // num_seqs + (i < config.max_num_batched_tokens % num_seqs)
               for i in range(num_seqs)]
    return [long_context, [(0, min(n, max_model_len)) for n in per_seq]]


def profile_memory(config: EngineConfig, loaded: LoadedModel, max_model_len: int, weight_bytes: int) -> MemoryFacts:
    from pdserve.engine.model_runner import ModelRunner  # torch: only where the engine runs

    held, available = resident_bytes(), available_bytes()
    peaks = []
    for step in dummy_steps(config, max_model_len):
        kv = KVCacheManager(sum(-(-(c + n) // config.block_size) for c, n in step), config.block_size, False)
        runner = ModelRunner(loaded, kv, kv.pool.num_blocks, config.torch_dtype, config.attention_backend)
        out = SchedulerOutput([_scheduled(kv, f"memory-profile-{i}", c, n) for i, (c, n) in enumerate(step)])
        peaks.append(peak_growth(lambda: runner.execute(out)))
        del runner, kv, out
    return MemoryFacts(available, held, weight_bytes, max(peaks))


def _scheduled(kv: KVCacheManager, req_id: str, num_computed: int, num_new: int) -> ScheduledRequest:
    request = Request(req_id, [0] * (num_computed + num_new), SamplingParams(max_tokens=1), -1, seed=0)
    kv.allocate_slots(request, num_computed + num_new)
    request.num_computed_tokens = num_computed
    return ScheduledRequest(request, num_new)

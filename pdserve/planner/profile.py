"""What the simulator knows of one node configuration on one machine, and where it is kept.

A `Profile` holds the fitted step-time model of a node running `setup` (threads, tensor-parallel
size, dtype, block size) on a model folder on a machine, the samples it was fitted to with the fit
error per kind of step, the bytes of one KV block, and the cost of moving KV. It is cached as JSON
under the pdserve cache dir (`profiles/<key>.json`), keyed by a hash of the model folder (its
config and the names and sizes of its weight files), the machine (CPU model, its capability flags,
its core count) and the setup: measured once, reused until one of them changes. The CPU per
request and per token of the serving stack around the engines (`ServingCosts`: the router's, a
node front's, a client's) is cached beside them, keyed by model and machine.

Must never: measure anything (pdserve/planner/measure.py does) or import torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.paths import default_cache_dir
from pdserve.engine.step_shape import StepShape
from pdserve.planner.step_cost import StepCost

PROFILE_VERSION = 7  # bump when what is measured, or how, changes: older files are measured again
COST_VERSION = 5  # the same for the serving stack's costs (pdserve/planner/measure_stack.py), measured apart
# CPU flags that change which kernels and dtypes the engine runs (pdserve/engine/dtype_choice.py, pdserve/kernels/).
CAPABILITY_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


@dataclass(frozen=True)
class NodeSetup:
    """One node's configuration as far as its step times depend on it."""

    threads: int
    dtype: str  # resolved: bfloat16 or float32, never auto
    block_size: int
    tensor_parallel_size: int = 1

    def describe(self) -> str:
        return (f"{self.threads} thread(s), TP {self.tensor_parallel_size}, {self.dtype}, "
                f"block {self.block_size}")


@dataclass(frozen=True)
class TransferCost:
    """Seconds to move KV between two nodes' caches: base + per_byte × bytes. And the CPU a push
    takes on each end, per push and per byte: the sending and the receiving process's, their UCX
    threads' included, spent on the node's cores beside its steps. Measured on a 2-core AVX2
    machine with the demo model: a push took 3.6 ms + 1.9 ns/byte and cost the sender 1.6 ms +
    3.3 ns/byte of CPU and the receiver 2.2 ms + 1.1 ns/byte (profiles before version 7 had no CPU
    and read as zero)."""

    base_s: float
    per_byte_s: float
    method: str  # how it was measured
    send_cpu_s: float = 0.0  # per push
    send_cpu_per_byte_s: float = 0.0
    receive_cpu_s: float = 0.0
    receive_cpu_per_byte_s: float = 0.0

    def time(self, num_bytes: int) -> float:
        return self.base_s + self.per_byte_s * num_bytes if num_bytes > 0 else 0.0

    def send_cpu(self, pushes: int, num_bytes: int) -> float:
        """The sender's CPU seconds for `pushes` pushes carrying `num_bytes` in all."""
        return pushes * self.send_cpu_s + num_bytes * self.send_cpu_per_byte_s

    def receive_cpu(self, pushes: int, num_bytes: int) -> float:
        """The receiver's CPU seconds for `pushes` pushes carrying `num_bytes` in all."""
        return pushes * self.receive_cpu_s + num_bytes * self.receive_cpu_per_byte_s


@dataclass(frozen=True)
class CpuCost:
    """One serving process's CPU per request and per streamed token."""

    per_request_s: float
    per_token_s: float
    method: str  # how it was measured

    @classmethod
    def free(cls):
        return cls(0.0, 0.0, "free")

    def of_request(self, tokens: float) -> float:
        """CPU seconds for one request that streams `tokens` tokens."""
        return self.per_request_s + tokens * self.per_token_s

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "version": COST_VERSION}

    @classmethod
    def from_json(cls, record: dict):
        record = dict(record)
        if record.pop("version", None) != COST_VERSION:
            raise ValueError(f"{cls.__name__} written by another version")
        return cls(**record)


class RouterCost(CpuCost):
    """The router's (one process, one event loop: the simulator runs it as a single
    first-come-first-served server)."""


class FrontCost(CpuCost):
    """A node front's: its gRPC server relaying what its engine core (a process of its own)
    sends. A disaggregated request passes two fronts (the prefill leg costs a request)."""


class ClientCost(CpuCost):
    """A streaming gRPC client's (the serving bench's): charged only when the load generator
    shares the nodes' machine, as when a plan is validated here."""


@dataclass(frozen=True)
class ServingCosts:
    """What the serving stack around the engines costs on this machine."""

    router: RouterCost = RouterCost.free()
    fronts: FrontCost = FrontCost.free()
    client: ClientCost = ClientCost.free()


STACK_PROCESSES = ("router", "front", "client")


def stack_keys(model_digest: str, machine: dict[str, object], stream_interval: int = 1) -> tuple[str, str, str]:
    """Where the router's, a node front's and a client's costs are cached (measured in one run),
    at the router's `--stream-interval`. The router tokenizes and detokenizes with the model's
    tokenizer; no node setup matters."""
    return tuple(cost_key(process, model_digest, machine, stream_interval) for process in STACK_PROCESSES)


def cost_key(process: str, model_digest: str, machine: dict[str, object], stream_interval: int = 1) -> str:
    facts: list[object] = [COST_VERSION, process, model_digest, machine]
    if stream_interval != 1:  # one token per response keeps the key it always had
        facts.append({"stream_interval": stream_interval})
    text = json.dumps(facts, sort_keys=True)
    return f"{process}-" + hashlib.sha256(text.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class StepSample:
    kind: str  # prefill, decode or mixed
    tokens: int
    requests: int
    attended: int
    decode_context: int
    seconds: float

    @property
    def shape(self) -> StepShape:
        return StepShape(self.tokens, self.requests, self.attended, self.decode_context)


@dataclass(frozen=True)
class Profile:
    model: str
    model_hash: str
    machine: dict[str, object]
    setup: NodeSetup
    step: StepCost
    fit_error: dict[str, float]  # kind of step -> relative RMS error of the fit on its samples
    samples: tuple[StepSample, ...]
    kv_block_bytes: int  # one block, every layer's K and V, as the node's KV cache holds it
    transfer: TransferCost
    max_model_len: int
    vocab_size: int

    def to_json(self) -> dict:
        record = dataclasses.asdict(self)
        record["version"] = PROFILE_VERSION
        return record

    @classmethod
    def from_json(cls, record: dict) -> Profile:
        record = dict(record)
        if record.pop("version", None) != PROFILE_VERSION:
            raise ValueError("profile written by another version")
        return cls(**{
            **record,
            "setup": NodeSetup(**record["setup"]),
            "step": StepCost(**record["step"]),
            "samples": tuple(StepSample(**s) for s in record["samples"]),
            "transfer": TransferCost(**record["transfer"]),
        })


def model_hash(model_dir: str | os.PathLike) -> str:
    """The folder's config.json bytes, and the name and size of each weight file (hashing gigabytes
    of weights to key a cache would cost more than the profile)."""
    folder = Path(model_dir)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for path in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return digest.hexdigest()[:16]


def machine_facts(cpuinfo: str | None = None, cores: int | None = None) -> dict[str, object]:
    """The CPU model, its capability flags that matter here, and the cores this process may use."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields = dict(line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"cpu": fields.get("model name", "unknown"), "flags": [f for f in CAPABILITY_FLAGS if f in flags],
            "cores": cores}


def profile_key(model_digest: str, machine: dict[str, object], setup: NodeSetup) -> str:
    text = json.dumps([PROFILE_VERSION, model_digest, machine, dataclasses.asdict(setup)], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


class ProfileCache:
    """Profiles as JSON files in one folder (default: <pdserve cache>/profiles)."""

    def __init__(self, folder: str | os.PathLike | None = None) -> None:
        self.folder = Path(folder) if folder is not None else default_cache_dir() / "profiles"

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.json"

    def load(self, key: str, kind: type = Profile):
        """The cached `kind` (a Profile or a CpuCost), or None when there is none (or it is
        unreadable: measured again)."""
        try:
            return kind.from_json(json.loads(self.path(key).read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def store(self, key: str, entry: Profile | CpuCost) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entry.to_json(), indent=1))
        tmp.replace(path)  # a reader never sees half a file
        return path

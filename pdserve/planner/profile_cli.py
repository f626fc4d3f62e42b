"""`pdserve profile`: measure (or read from the cache) what the simulator needs of each node
configuration on this machine, and print the fitted step-time model with its fit error, and the CPU per request and per
token of the serving stack around the engines (the router, a node front, a client).

    pdserve profile [--model DIR] [--threads 1,2] [--tp 1,2] [--dtype auto] [--block-size 16] [--remeasure]
        [--skip-router]

`profiles_for` and `serving_costs_for` are also what `pdserve plan` calls: a cached profile is reused, a missing one
is measured (a progress bar on stderr) and stored. Owns the flags and the printing; the measuring is
pdserve/planner/measure.py's and pdserve/planner/measure_stack.py's, imported only when something must be
measured.
"""

from __future__ import annotations

import argparse
import sys

from pdserve.common.refusal import Refused
from pdserve.engine.config import DEFAULT_BLOCK_SIZE, DTYPE_NAMES
from pdserve.planner.profile import (
    ClientCost, CpuCost, FrontCost, NodeSetup, Profile, ProfileCache, RouterCost, ServingCosts, machine_facts,
    model_hash, profile_key, stack_keys,
)


def int_list(flag: str):
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{flag} needs integers >= 1, got {text!r}")
        return values
    return parse


def profiles_for(model: str, setups: list[tuple[int, int]], dtype: str, block_size: int, cache: ProfileCache,
                 progress: bool = True, remeasure: bool = False, log=print) -> dict[tuple[int, int], Profile]:
    """One profile per (threads, tensor-parallel size) of a node, from the cache or measured now
    (and cached)."""
    from pdserve.engine.dtype_choice import resolve_dtype
    from pdserve.engine.model_folder import open_model_folder

    open_model_folder(model)  # a folder no node could serve is refused here, in one line
    resolved = resolve_dtype(dtype)
    digest, machine = model_hash(model), machine_facts()
    profiles = {}
    for count, tp in sorted(set(setups)):
        setup = NodeSetup(count, resolved, block_size, tp)
        key = profile_key(digest, machine, setup)
        profile = None if remeasure else cache.load(key)
        if profile is None:
            from pdserve.planner.measure import measure_profile  # torch and the model: only when measuring

            profile = measure_profile(model, setup, progress)
            log(f"profile: measured {setup.describe()}, stored in {cache.store(key, profile)}")
        profiles[(count, tp)] = profile
    return profiles


def tp_setups(threads: list[int], tp_sizes: list[int]) -> list[tuple[int, int]]:
    """(threads, TP) for every TP size that divides the threads count (each rank a share of them)."""
    return [(count, tp) for count in threads for tp in tp_sizes if count % tp == 0]


def serving_costs_for(model: str, cache: ProfileCache, remeasure: bool = False, log=print,
                      stream_interval: int = 1) -> ServingCosts:
    """The serving stack's costs on this machine for this model at the router's `stream_interval`,
    from the cache or measured now (and cached)."""
    keys = stack_keys(model_hash(model), machine_facts(), stream_interval)
    kinds = (RouterCost, FrontCost, ClientCost)
    cached = [None if remeasure else cache.load(key, kind) for key, kind in zip(keys, kinds)]
    if None not in cached:
        return ServingCosts(*cached)
    from pdserve.planner.measure_stack import measure_stack_cost  # a real cluster: only when measuring

    at = "" if stream_interval == 1 else f" at --stream-interval {stream_interval}"
    log(f"profile: measuring the router, a node front and a client on a local colocated cluster{at} ...")
    costs = measure_stack_cost(model, stream_interval=stream_interval)
    stored = [cache.store(key, cost) for key, cost in zip(keys, (costs.router, costs.fronts, costs.client))]
    log(f"profile: measured them, stored in {', '.join(str(path) for path in stored)}")
    return costs


def format_costs(costs: ServingCosts) -> str:
    return "\n".join(format_cost(name, cost) for name, cost in
                     (("router", costs.router), ("node front", costs.fronts), ("client", costs.client)))


def format_cost(name: str, cost: CpuCost) -> str:
    return (f"{name} ≈ {cost.per_request_s * 1e6:.0f} µs/request + {cost.per_token_s * 1e6:.1f} µs/token "
            f"({cost.method})")


def format_profile(profile: Profile) -> str:
    step, t = profile.step, profile.transfer
    errors = ", ".join(f"{kind} {err:.0%}" for kind, err in sorted(profile.fit_error.items()))
    return "\n".join([
        f"{profile.setup.describe()} on {profile.machine.get('cpu')} ({profile.machine.get('cores')} cores)",
        f"  step ≈ {step.base_s * 1e3:.3f} ms + {step.per_token_s * 1e6:.2f} µs/token + {step.per_seq_s * 1e6:.2f} µs/request"
        f" + {step.per_attended_s * 1e9:.3f} ns/attended pair + {step.per_decode_context_s * 1e9:.2f} ns/decode KV token",
        f"  fit error (relative RMS, {len(profile.samples)} steps): {errors}",
        f"  KV: {profile.kv_block_bytes} bytes/block; transfer ≈ {profile.transfer.base_s * 1e3:.3f} ms + "
        f"{profile.transfer.per_byte_s * 1e9:.3f} ns/byte ({profile.transfer.method})",
        f"  CPU a push takes: sender {_push_cpu(t.send_cpu_s, t.send_cpu_per_byte_s)}, receiver "
        f"{_push_cpu(t.receive_cpu_s, t.receive_cpu_per_byte_s)}",
    ])


def _push_cpu(per_push_s: float, per_byte_s: float) -> str:
    return f"{per_push_s * 1e3:.3f} ms + {per_byte_s * 1e9:.3f} ns/byte"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve profile", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the built-in demo model)")
    p.add_argument("--threads", type=int_list("--threads"), default=[1], help="comma-separated torch threads per node")
    p.add_argument("--tp", type=int_list("--tp"), default=[1],
                   help="comma-separated tensor-parallel sizes (--tensor-parallel-size), each measured for every "
                        "--threads count it divides, its ranks started as a node starts them")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="auto")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--remeasure", action="store_true", help="measure even when a cached profile exists")
    p.add_argument("--skip-router", action="store_true",
                   help="do not measure (or print) the serving stack's cost (router, node front, client)")
    p.add_argument("--profile-dir", help="where profiles are cached (default: <pdserve cache>/profiles)")
    p.add_argument("--no-progress", action="store_true")
    return p


def default_model(model: str | None) -> str:
    if model is not None:
        return model
    from pdserve.model_factory import ensure_demo_model

    return str(ensure_demo_model())


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.block_size < 1:
        p.error("--block-size must be >= 1")
    try:
        model, cache = default_model(args.model), ProfileCache(args.profile_dir)
        setups = tp_setups(args.threads, args.tp)
        if not setups:
            p.error("--tp: no size divides any --threads count")
        profiles = profiles_for(model, setups, args.dtype, args.block_size, cache, not args.no_progress,
                                args.remeasure)
        costs = None if args.skip_router else serving_costs_for(model, cache, args.remeasure)
    except Refused as err:
        print(f"pdserve profile: {err.cli_message()}", file=sys.stderr)
        return err.exit_code
    for profile in profiles.values():
        print(format_profile(profile))
    if costs is not None:
        print(format_costs(costs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

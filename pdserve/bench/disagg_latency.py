"""One request through a local 1P1D cluster: TTFT, prefill time and the KV transfer's cost.

    python -m pdserve.bench.disagg_latency [--model-dir DIR] [--prompt-len 512] [--repeats 3]
                                           [--prefill-tp T] [--decode-tp T] [--auth-token-file PATH]
                                           [--no-kv-checksums] [--tls]

Builds (once) the smol135m-shaped model in bf16, starts router + 1 prefill + 1 decode
node on 127.0.0.1, sends one request of `--prompt-len` random tokens at a time, and
prints, per run and as the median: TTFT, the time to token 2 (the decode node's first,
which waits for the KV), the prefill node's time to token 1, how long token 1 waited on
the transfer after it was sampled (0 once it is connected: token 1 leaves at once and
the KV follows), the decode rate after token 2, the bytes moved, the transport's push-to-ack time,
and its throughput against a memory-copy bandwidth measured in this process.
Ratios, not absolute claims: this machine is shared and noisy. The copy rate counts
each byte once, as the transfer does. With a token (`--auth-token-file`, else
`$PDSERVE_AUTH_TOKEN`) the cluster requires it and the benchmark sends it. `--no-kv-checksums`
starts the decode node without KV checksums (pdserve/kv_transfer/integrity.py), to measure their cost;
`--tls` starts the cluster with `--tls` (every gRPC hop over TLS), to measure its cost.
With `--prefill-tp`/`--decode-tp` above 1 the pools' nodes run that many tensor-parallel
ranks (`--tp`, each rank `--threads` torch threads); the same requests then go first through
a TP=1/TP=1 cluster, and TTFT, token 2 and prefill are reported as TP over that baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from pdserve.common.auth import add_auth_args, call_metadata, token_or_usage_error
from pdserve.common.tls import TlsConfig, sync_channel
from pdserve.bench.common import copy_bandwidth, ensure_model, local_cluster
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

COPY_BYTES = 256 << 20
PROMPT_ID_LIMIT = 1700  # prompt ids are drawn below this, and below the model's vocabulary


def copy_rate(nbytes: int = COPY_BYTES) -> float:
    """Bytes per second of a local copy, each byte counted once (as a transfer counts it)."""
    return copy_bandwidth(nbytes) / 2  # copy_bandwidth counts bytes read + written


def one_request(router: str, prompt: list[int], max_tokens: int, auth_token: str | None,
                tls: TlsConfig | None = None) -> dict[str, float]:
    request = pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=prompt),
        sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    with sync_channel(router, tls) as channel:
        start = time.perf_counter()
        arrivals: list[float] = []  # one per token, as the client sees them
        last = None
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        for response in stub.Generate(request, timeout=600, metadata=call_metadata(auth_token)):
            arrivals += [time.perf_counter()] * len(response.token_ids)
            last = response
    return {
        "client_ttft_s": arrivals[0] - start,
        # Token 2 is the decode node's first: it waits for the KV that token 1 no longer waits for.
        "client_token2_s": arrivals[1] - start if len(arrivals) > 1 else float("nan"),
        "client_decode_tokens_per_s": ((len(arrivals) - 2) / (arrivals[-1] - arrivals[1])
                                       if len(arrivals) > 2 and arrivals[-1] > arrivals[1] else float("nan")),
        "router_ttft_s": last.timings.ttft_s,
        "prefill_s": last.timings.prefill_s,
        "kv_transfer_after_token1_s": last.timings.kv_transfer_s,
        "kv_transfer_bytes": last.timings.kv_transfer_bytes,
    }


def run(args: argparse.Namespace, auth_token: str | None = None) -> dict:
    """One cluster at the asked TP sizes; with TP, the TP=1/TP=1 baseline first on the same requests."""
    model_dir = args.model_dir or ensure_model("llama", "smol135m", "bfloat16")
    if (args.prefill_tp, args.decode_tp) == (1, 1):
        return measure(args, model_dir, 1, 1, auth_token)
    baseline = measure(args, model_dir, 1, 1, auth_token)
    print_result(baseline, args)
    result = measure(args, model_dir, args.prefill_tp, args.decode_tp, auth_token)
    return {**result, "baseline": baseline, "tp_over_baseline": tp_over_baseline(result, baseline)}


def tp_over_baseline(result: dict, baseline: dict) -> dict:
    """TP cluster over TP=1 cluster, medians (above 1: the TP cluster took longer)."""
    keys = ("client_ttft_s", "client_token2_s", "prefill_s")
    return {key: result["median"][key] / baseline["median"][key] if baseline["median"][key] else None
            for key in keys}


def measure(args: argparse.Namespace, model_dir: str | os.PathLike, prefill_tp: int, decode_tp: int,
            auth_token: str | None) -> dict:
    rng = random.Random(args.seed)  # the same requests at every TP size
    id_limit = min(PROMPT_ID_LIMIT, _vocab_size(model_dir))
    node_args = ("--num-blocks", "2048", "--max-num-batched-tokens", str(args.chunk), "--max-num-seqs", "16")
    checksums = () if args.kv_checksums else ("--no-kv-checksums",)  # the receiver's choice
    kind_args = {"prefill": ("--tp", str(prefill_tp)), "decode": ("--tp", str(decode_tp), *checksums)}
    runs = []
    tls = ("--tls",) if args.tls else ()  # a private CA and mutual TLS among the children (pdserve/cluster_tls.py)
    with local_cluster(model_dir, ("--prefill", "1", "--decode", "1"), node_args,
                       ("--threads-per-node", str(args.threads), *tls), auth_token, kind_args) as cluster:
        client_tls, auth_token = cluster.state.tls(), cluster.token  # --tls makes a token when none is given
        one_request(cluster.router, [rng.randrange(1, id_limit) for _ in range(32)], 2, auth_token,
                    client_tls)  # warm up
        before = _prefill_counters(cluster)
        for _ in range(args.repeats):
            prompt = [rng.randrange(1, id_limit) for _ in range(args.prompt_len)]
            runs.append(one_request(cluster.router, prompt, args.max_tokens, auth_token, client_tls))
        after = _prefill_counters(cluster)
    pushes = after.transfers - before.transfers
    push_s = after.latency_s - before.latency_s
    moved = after.bytes - before.bytes
    bandwidth = copy_rate()
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {
        "model_dir": str(model_dir), "prompt_len": args.prompt_len, "chunk": args.chunk,
        "prefill_tp": prefill_tp, "decode_tp": decode_tp, "kv_checksums": args.kv_checksums, "tls": args.tls,
        "runs": runs,
        "median": median,
        "transport": {"pushes": pushes, "bytes": moved, "push_to_ack_s": push_s,
                      "throughput_bytes_per_s": moved / push_s if push_s else 0.0},
        "copy_bytes_per_s": bandwidth,
        "ratios": {
            "kv_transfer_after_token1_over_prefill": median["kv_transfer_after_token1_s"] / median["prefill_s"],
            "push_to_ack_per_request_over_prefill": (push_s / args.repeats) / median["prefill_s"],
            "transfer_throughput_over_copy_bandwidth": (moved / push_s) / bandwidth if push_s else 0.0,
        },
    }


def _vocab_size(model_dir: str | os.PathLike) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True).get_text_config().vocab_size


def _prefill_counters(cluster):
    (name,) = cluster.names("prefill")
    return cluster.stats(name).kv_transfer


def print_result(result: dict, args: argparse.Namespace) -> None:
    m, r, t = result["median"], result["ratios"], result["transport"]
    print(f"prompt {args.prompt_len} tokens, prefill TP={result['prefill_tp']}, decode TP={result['decode_tp']}, "
          f"KV checksums {'on' if result['kv_checksums'] else 'off'}, TLS {'on' if result['tls'] else 'off'}, "
          f"median of {args.repeats}:")
    print(f"  TTFT (client)              {m['client_ttft_s'] * 1e3:8.1f} ms")
    print(f"  token 2 (client)           {m['client_token2_s'] * 1e3:8.1f} ms")
    print(f"  decode after token 2       {m['client_decode_tokens_per_s']:8.1f} tokens/s")
    print(f"  prefill (P, to token 1)    {m['prefill_s'] * 1e3:8.1f} ms")
    print(f"  token 1 waiting on the KV  {m['kv_transfer_after_token1_s'] * 1e3:8.1f} ms "
          f"({r['kv_transfer_after_token1_over_prefill']:.3f} x prefill)")
    print(f"  KV bytes per request       {m['kv_transfer_bytes'] / 1e6:8.2f} MB")
    print(f"  push-to-ack per request    {t['push_to_ack_s'] / args.repeats * 1e3:8.1f} ms "
          f"({r['push_to_ack_per_request_over_prefill']:.3f} x prefill, overlapped with compute)")
    print(f"  transfer throughput        {t['throughput_bytes_per_s'] / 1e9:8.2f} GB/s "
          f"= {r['transfer_throughput_over_copy_bandwidth']:.3f} x memory copy "
          f"({result['copy_bytes_per_s'] / 1e9:.1f} GB/s)", flush=True)


def print_tp_over_baseline(ratios: dict) -> None:
    print("TP over the TP=1/TP=1 baseline (same run, same requests):")
    for key, label in (("client_ttft_s", "TTFT"), ("client_token2_s", "token 2"), ("prefill_s", "prefill")):
        value = ratios[key]
        print(f"  {label:<26} {'n/a' if value is None else f'{value:.2f}x'}")


def check_split(model_dir: str | os.PathLike, sizes: tuple[int, ...]) -> str | None:
    """Why a pool's TP size cannot split the model, before any cluster starts; None when all can."""
    from pdserve.engine.model_folder import ModelRefused
    from pdserve.engine.model_loader import check_tensor_parallel

    for size in sorted(set(sizes) - {1}):
        try:
            check_tensor_parallel(model_dir, "auto", size)
        except ModelRefused as exc:
            return f"TP {size}: {exc.reason} (pass --model-dir of a model whose shapes split)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench disagg-latency", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=512, help="prefill node's max_num_batched_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel ranks of the prefill node")
    parser.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel ranks of the decode node")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-checksums", action=argparse.BooleanOptionalAction, default=True,
                        help="the decode node checks every KV push's checksums (its default)")
    parser.add_argument("--tls", action="store_true",
                        help="start the cluster with --tls: mutual TLS among the router and the nodes and to the client")
    parser.add_argument("--out", type=Path, default=Path("results/disagg_latency.json"))
    add_auth_args(parser)
    args = parser.parse_args(argv)
    if min(args.prefill_tp, args.decode_tp) < 1:
        parser.error("--prefill-tp and --decode-tp must be >= 1")
    auth_token = token_or_usage_error(parser, args.auth_token_file, os.environ)
    model_dir = args.model_dir or ensure_model("llama", "smol135m", "bfloat16")
    refused = check_split(model_dir, (args.prefill_tp, args.decode_tp))
    if refused is not None:
        parser.error(refused)
    args.model_dir = model_dir
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores", flush=True)
    result = run(args, auth_token)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_result(result, args)
    if "tp_over_baseline" in result:
        print_tp_over_baseline(result["tp_over_baseline"])
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

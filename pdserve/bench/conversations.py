"""Multi-turn conversations as a `pdserve bench serve --workload jsonl` dataset.

    python -m pdserve.bench.conversations --conversations 16 --turns 4 --out conv.jsonl
    pdserve bench serve --addr HOST:PORT --workload jsonl --dataset conv.jsonl --rate 6 --num-requests 64

Each conversation opens with its own system text; every turn adds a user message, and the
prompt of turn t is the whole conversation so far (the previous turns' prompts, an assistant
reply after each, this turn's message). Lines go turn by turn: turn 1 of every conversation,
then turn 2, and so on, so a conversation's next turn arrives while the others are served.
What it measures: whether the router sends a turn to the node that holds its history in the
prefix cache (the node's `pdserve_prefix_cache_hits`), and what that saves in TTFT.
Seeded: the same flags write the same file.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = ("the", "model", "cache", "router", "token", "prompt", "node", "decode", "prefill", "block", "queue",
         "server", "request", "stream", "answer", "question", "system", "user", "assistant", "memory", "time",
         "first", "second", "third", "when", "where", "which", "every", "never", "always", "small", "large",
         "fast", "slow", "cluster", "core", "batch", "step", "chunk", "layer", "head", "weight", "value", "key")


def conversations(count: int, turns: int, system_words: int, user_words: int, reply_words: int, output_len: int,
                  seed: int) -> list[dict[str, object]]:
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    histories = [f"System: conversation {c}. {text(system_words)}" for c in range(count)]
    lines = []
    for _ in range(turns):
        for c in range(count):
            histories[c] += f"\nUser: {text(user_words)}\nAssistant:"
            lines.append({"prompt": histories[c], "output_len": output_len})
            histories[c] += " " + text(reply_words)
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.conversations", description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-words", type=int, default=150)
    p.add_argument("--user-words", type=int, default=30)
    p.add_argument("--reply-words", type=int, default=20)
    p.add_argument("--output-len", type=int, default=16, help="tokens each turn asks for")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="the jsonl file to write")
    args = p.parse_args(argv)
    for flag in ("conversations", "turns", "output_len"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    lines = conversations(args.conversations, args.turns, args.system_words, args.user_words, args.reply_words,
                          args.output_len, args.seed)
    args.out.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    print(f"{len(lines)} requests ({args.conversations} conversations x {args.turns} turns) in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

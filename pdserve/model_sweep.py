"""Every causal-LM architecture transformers knows, tiny, through the engine: exact or refused.

`pdserve sweep-models` builds each model type of transformers' causal-LM auto mapping tiny with
random weights (pdserve/tiny_models.py) and starts `LLM` on it the way a user would, in float32.
Each type ends as one `SweepResult`:
- EXACT: served, and greedy output equals transformers `generate` token for token (a divergence
  only after a near-tie in the reference, top-2 logits within `NEAR_TIE`), on the native or the
  transformers path;
- REFUSED: `LLM` refused the folder at start, with the one line naming it and the reason; for a
  family the recipe cannot make tiny, a folder of its default config (no weights) was refused
  by the checks every entry point runs before loading;
- NOT_BUILT: the generic recipe cannot make this family tiny and its default config passes
  those checks (the reason is transformers');
- WRONG or CRASHED: served with other tokens than transformers, or failed otherwise than by a
  refusal (a KV block still held once every request ended counts as a crash). Neither may ever appear: tests/integration/test_model_sweep.py fails on them.

`--markdown` prints the report docs/models.md holds. Must never download anything.
"""

from __future__ import annotations

import argparse
import enum
import logging
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging as hf_logging

from pdserve.engine.model_folder import ModelRefused, one_line, open_model_folder
from pdserve.engine.model_loader import load_reference_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model_factory import SMALL_TOKENIZER_VOCAB, build_tokenizer
from pdserve.tiny_models import NotBuilt, build_tiny_model

SWEEP_PROMPTS = ("The quick brown fox jumps over the lazy dog. " * 3, "def add(x, y):\n    return")
SWEEP_MAX_TOKENS = 8
NEAR_TIE = 1e-4  # top-1 minus top-2 logit below which a divergence is a tie, not an error
REFERENCE_ATTENTION = "eager"  # every class that takes an attention implementation has it


class Outcome(enum.Enum):
    EXACT = "exact"
    REFUSED = "refused at start"
    NOT_BUILT = "not built"
    WRONG = "WRONG TOKENS"
    CRASHED = "CRASHED"


@dataclass(frozen=True)
class SweepResult:
    model_type: str
    outcome: Outcome
    detail: str  # EXACT: the path it ran on; else the reason


def causal_lm_types() -> list[str]:
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def sweep(model_types: list[str], root: Path) -> list[SweepResult]:
    tokenizer = build_tokenizer(SMALL_TOKENIZER_VOCAB)
    return [sweep_one(model_type, root / model_type, tokenizer) for model_type in model_types]


def sweep_one(model_type: str, folder: Path, tokenizer) -> SweepResult:
    try:
        build_tiny_model(model_type, folder, tokenizer)
    except NotBuilt as exc:
        return _default_config_result(model_type, folder, tokenizer, str(exc))
    return serve_and_compare(model_type, folder, tokenizer)


def serve_and_compare(model_type: str, folder: Path, tokenizer) -> SweepResult:
    """`LLM` on a built folder, as a user starts it: EXACT, REFUSED, WRONG or CRASHED."""
    from pdserve.llm import LLM

    prompts = [tokenizer.encode(p) for p in SWEEP_PROMPTS]
    try:
        llm = LLM(folder, dtype="float32", num_blocks=64)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=SWEEP_MAX_TOKENS, temperature=0, ignore_eos=True),
                               use_tqdm=False)
    except ModelRefused as exc:
        return SweepResult(model_type, Outcome.REFUSED, exc.reason)
    except Exception as exc:  # noqa: BLE001 - what a user would see instead of a refusal
        return SweepResult(model_type, Outcome.CRASHED, f"{type(exc).__name__}: {one_line(exc)}")
    leaked = llm.engine.kv.num_used_blocks
    if leaked:
        return SweepResult(model_type, Outcome.CRASHED, f"{leaked} KV blocks still held after every request ended")
    got = [o.outputs[0].token_ids for o in outputs]
    mismatch = first_mismatch(folder, prompts, got)
    if mismatch is not None:
        return SweepResult(model_type, Outcome.WRONG, mismatch)
    return SweepResult(model_type, Outcome.EXACT, llm.engine.loaded.impl)


def _default_config_result(model_type: str, folder: Path, tokenizer, not_built: str) -> SweepResult:
    """A type the recipe cannot make tiny: is a folder of its default config (no weights) refused
    by the checks every entry point runs before loading? Then every such checkpoint is."""
    try:
        AutoConfig.for_model(model_type).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    except Exception:  # noqa: BLE001 - its default config does not even save
        return SweepResult(model_type, Outcome.NOT_BUILT, not_built)
    try:
        open_model_folder(folder)
    except ModelRefused as exc:
        return SweepResult(model_type, Outcome.REFUSED, exc.reason)
    except Exception as exc:  # noqa: BLE001 - what the router and every node would crash on
        return SweepResult(model_type, Outcome.CRASHED, f"{type(exc).__name__}: {one_line(exc)}")
    return SweepResult(model_type, Outcome.NOT_BUILT, not_built)


@torch.inference_mode()
def first_mismatch(folder: Path, prompts: list[list[int]], outputs: list[list[int]]) -> str | None:
    """Where `outputs` leave transformers' greedy `generate` on a clear top-1 (None: nowhere)."""
    model = load_reference_model(folder, torch.float32, REFERENCE_ATTENTION)
    for i, (prompt, got) in enumerate(zip(prompts, outputs)):
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=len(got), eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        expected = out.sequences[0, len(prompt):].tolist()
        j = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        if j is None and len(got) == len(expected):
            continue
        if j is None:
            return f"prompt {i}: {len(got)} tokens, transformers made {len(expected)}"
        top2 = torch.topk(out.logits[j][0].float(), 2).values
        if float(top2[0] - top2[1]) >= NEAR_TIE:
            return f"prompt {i}: token {j} is {got[j]}, transformers says {expected[j]}"
    return None


def markdown_report(results: list[SweepResult]) -> str:
    """What docs/models.md holds: the served types by path, the others grouped by reason."""
    exact = [r for r in results if r.outcome is Outcome.EXACT]
    lines = [summary(results), "", f"### Served, token-exact against transformers ({len(exact)})", ""]
    for impl in ("native", "transformers"):
        names = [f"`{r.model_type}`" for r in exact if r.detail == impl]
        lines.append(f"- {impl} path ({len(names)}): {', '.join(names)}")
    for outcome in (Outcome.REFUSED, Outcome.NOT_BUILT, Outcome.WRONG, Outcome.CRASHED):
        group = [r for r in results if r.outcome is outcome]
        if not group:
            continue
        lines += ["", f"### {outcome.value.capitalize()} ({len(group)})", "", "| reason | model types |", "| --- | --- |"]
        by_reason: dict[str, list[str]] = {}
        for r in group:
            by_reason.setdefault(_without_name(r.detail), []).append(f"`{r.model_type}`")
        lines += [f"| {reason.replace('|', '/')} | {', '.join(names)} |" for reason, names in by_reason.items()]
    return "\n".join(lines)


def _without_name(reason: str) -> str:
    """A refusal's reason less the model type or class it starts with, so that alike ones group."""
    return re.sub(r"^[^\s:]+: ", "", reason)


def summary(results: list[SweepResult]) -> str:
    counts = {o: sum(r.outcome is o for r in results) for o in Outcome}
    native = sum(r.outcome is Outcome.EXACT and r.detail == "native" for r in results)
    return (f"{len(results)} model types: {counts[Outcome.EXACT]} exact ({native} native), "
            f"{counts[Outcome.REFUSED]} refused at start, {counts[Outcome.NOT_BUILT]} not built, "
            f"{counts[Outcome.WRONG]} wrong, {counts[Outcome.CRASHED]} crashed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve sweep-models", description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", help="model types to sweep (default: every one)")
    parser.add_argument("--markdown", action="store_true", help="print the results as docs/models.md holds them")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.model_types) - set(causal_lm_types()))
    if unknown:
        parser.error(f"not causal-LM model types of this transformers: {', '.join(unknown)}")
    logging.disable(logging.WARNING)  # each family's own warnings would drown the table
    hf_logging.disable_progress_bar()
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    with tempfile.TemporaryDirectory(prefix="pdserve-sweep-") as root:
        results = sweep(args.model_types or causal_lm_types(), Path(root))
    if args.markdown:
        print(markdown_report(results))
    else:
        for r in results:
            print(f"{r.model_type:28} {r.outcome.value:18} {r.detail}")
    print(summary(results), file=sys.stderr)
    return int(any(r.outcome in (Outcome.WRONG, Outcome.CRASHED) for r in results))

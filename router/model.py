"""What the router knows of the model: its tokenizer and the facts of its config.

Owns loading the tokenizer and config from a model directory; the EOS ids are the
engine's own union (engine/model_facts.py), so router and nodes stop on the same
tokens. It must never load weights or import the engine's model code: the router runs
no model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from pdserve.engine.model_facts import eos_token_ids


@dataclass(frozen=True)
class RouterModel:
    name: str
    tokenizer: PreTrainedTokenizerBase = field(repr=False)
    vocab_size: int  # rows of the lm_head: the ids a prompt may contain
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype: str


def load_router_model(model_dir: str | os.PathLike) -> RouterModel:
    """Tokenizer + config of a local model directory (never the network, never the weights)."""
    path = Path(model_dir)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    text = config.get_text_config()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return RouterModel(
        name=path.name,
        tokenizer=tokenizer,
        vocab_size=text.vocab_size,
        max_model_len=text.max_position_embeddings,
        eos_token_ids=eos_token_ids(path, config, tokenizer.eos_token_id),
        dtype=_dtype_name(text.to_dict()),
    )


def _dtype_name(config: dict) -> str:
    dtype = config.get("dtype") or config.get("torch_dtype") or ""
    return str(dtype).removeprefix("torch.")

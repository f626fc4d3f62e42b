"""Facts read from a transformers config, in one place: config classes differ in which keys
they define at all, so every read goes through `optional`.

Shared by the engine's loader and the router (which runs no model but must judge the
same stop tokens), so it imports nothing but transformers' config classes and never
loads weights or a tokenizer itself.
"""

from __future__ import annotations

from pathlib import Path

from transformers import GenerationConfig, PretrainedConfig


def optional(config: PretrainedConfig, key: str):
    """The config's value for key, or None where its class has no such key."""
    return config.to_dict().get(key)


def num_kv_heads(text: PretrainedConfig) -> int:
    # GPT-BigCode and Falcon: one KV head, whatever the other keys say; but Falcon-40B's new decoder
    # architecture ignores multi_query (its num_key_value_heads is the count then).
    if optional(text, "multi_query") and not optional(text, "new_decoder_architecture"):
        return 1
    kv = optional(text, "num_key_value_heads")
    return kv if kv is not None else text.num_attention_heads


def head_dim(text: PretrainedConfig) -> int:
    explicit = optional(text, "head_dim")
    return explicit if explicit is not None else text.hidden_size // text.num_attention_heads


def eos_token_ids(model_dir: Path, config: PretrainedConfig, tokenizer_eos: int | None) -> tuple[int, ...]:
    """The union, in this order and without repeats, of the EOS ids of the model directory's
    generation config (when it has one), of the model config and of the tokenizer
    (`tokenizer_eos`): a model may end a turn with any of them."""
    candidates = [optional(config.get_text_config(), "eos_token_id"), tokenizer_eos]
    if (model_dir / "generation_config.json").is_file():
        candidates.insert(0, GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id)
    ids: list[int] = []
    for candidate in candidates:
        for token_id in candidate if isinstance(candidate, list) else [candidate]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return tuple(ids)

"""Facts read from a transformers config, in one place: config classes differ in which keys
they define at all, so every read goes through `optional`."""

from __future__ import annotations

from transformers import PretrainedConfig


def optional(config: PretrainedConfig, key: str):
    """The config's value for key, or None where its class has no such key."""
    return config.to_dict().get(key)


def num_kv_heads(text: PretrainedConfig) -> int:
    kv = optional(text, "num_key_value_heads")
    return kv if kv is not None else text.num_attention_heads


def head_dim(text: PretrainedConfig) -> int:
    explicit = optional(text, "head_dim")
    return explicit if explicit is not None else text.hidden_size // text.num_attention_heads

"""pdserve/engine/model_facts.py on model folders written to disk: the EOS-id union the engine's
loader and the router both take, so a node and the router stop on the same tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig, GenerationConfig, LlamaConfig

from pdserve.engine.model_facts import eos_token_ids
from pdserve.router.model import load_router_model


def config_folder(tmp_path, config_eos, generation_eos=None):
    LlamaConfig(eos_token_id=config_eos).save_pretrained(tmp_path)
    if generation_eos is not None:
        GenerationConfig(eos_token_id=generation_eos).save_pretrained(tmp_path)
    return tmp_path, AutoConfig.from_pretrained(tmp_path, local_files_only=True)


@pytest.mark.parametrize("config_eos, generation_eos, tokenizer_eos, expected", [
    (2, [5, 2], 9, (5, 2, 9)),  # generation config first, then config, then tokenizer; no repeats
    ([2, 7], None, 7, (2, 7)),  # no generation_config.json: config's list, the tokenizer's already in it
    (None, 4, None, (4,)),  # only the generation config names one
    (3, None, None, (3,)),
])
def test_the_union_of_generation_config_config_and_tokenizer(tmp_path, config_eos, generation_eos, tokenizer_eos,
                                                             expected):
    folder, config = config_folder(tmp_path, config_eos, generation_eos)
    assert eos_token_ids(folder, config, tokenizer_eos) == expected


def test_the_router_stops_on_the_union_too(tiny_model, tmp_path):
    path = Path(shutil.copytree(tiny_model, tmp_path / "tiny"))  # a copy: the shared folder is never changed
    generation = json.loads((path / "generation_config.json").read_text())
    generation["eos_token_id"] = [3, 0]
    (path / "generation_config.json").write_text(json.dumps(generation))
    assert load_router_model(path).eos_token_ids == (3, 0)  # config and tokenizer say 0: no repeat

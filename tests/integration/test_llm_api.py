"""The offline API on a real model: seeds, n, stop conditions, streaming, logprobs, rejections.

Every test ends with zero blocks in use.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.engine_core import RequestRejected
from pdserve.engine.request import FinishReason

from .reference import peak_blocks


@pytest.fixture(scope="module")
def llm(model_dirs) -> LLM:
    return LLM(model_dirs["llama"], dtype="float32", block_size=8, max_num_batched_tokens=64, max_num_seqs=16)


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        assert engine.kv.num_used_blocks == 0
        assert not engine.has_unfinished()


PROMPTS = ["Hello there, general", "def add(a, b):\n    return", "pdserve splits prefill from decode", "x" * 50]


def test_seeded_sampling_is_independent_of_the_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, max_tokens=24, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, seed=n, ignore_eos=True) for n in (5, 30, 11)]
    batch = llm.generate(PROMPTS[1:] + [PROMPTS[0]], others + [params], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
    first = llm.generate([PROMPTS[0]] + PROMPTS[1:], [params] + others, use_tqdm=False)
    assert first[0].outputs[0].token_ids == alone


def test_seeded_sampling_is_independent_of_chunk_and_block_size(model_dirs, llm):
    params = SamplingParams(temperature=0.8, max_tokens=20, seed=7, ignore_eos=True)
    expected = llm.generate(PROMPTS, params, use_tqdm=False)
    other = LLM(model_dirs["llama"], dtype="float32", block_size=16, max_num_batched_tokens=16, max_num_seqs=4)
    got = other.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert other.engine.kv.num_used_blocks == 0


def test_n_samples_share_the_prompt_blocks(llm):
    prompt = list(range(1, 100))  # 12 full blocks of 8 and a partial one of 3 tokens
    kv = llm.engine.kv
    copies_before = kv.num_cow_copies
    with peak_blocks(llm) as peak:
        params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
        (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 16 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3  # distinct random streams
    # The prompt is computed once; the three samples share all 13 of its blocks. Writing token 100
    # into the shared partial block copies it for two of them (the last writer holds it alone by
    # then); every later token goes to blocks of their own: 12 + 3 * 3 blocks at most, not 3 * 15.
    assert kv.num_cow_copies - copies_before == 2
    assert peak[0] == 12 + 3 * 3


def test_n_samples_draw_what_separate_seeded_requests_draw(llm):
    prompt = PROMPTS[0]
    (together,) = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12,
                                                        ignore_eos=True), use_tqdm=False)
    sample_0 = llm.generate([prompt], SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
    assert together.outputs[0].token_ids == sample_0


def test_greedy_n_gives_identical_samples(llm):
    (out,) = llm.generate([PROMPTS[1]], SamplingParams(n=2, temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == out.outputs[1].token_ids


def test_stop_string_cuts_text_and_frees_blocks(llm):
    free_run = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    text = free_run[0].outputs[0].text
    stop = text[10:13]
    assert len(stop) == 3 and text.find(stop) == 10
    (out,) = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=40, stop=[stop], ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].text == text[:10]
    assert out.outputs[0].finish_reason is FinishReason.STOP
    assert out.outputs[0].stop_reason == stop
    assert len(out.outputs[0].token_ids) < 40


def test_stop_token_ids_and_min_tokens(llm):
    free_run = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    tokens = free_run[0].outputs[0].token_ids
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    (out,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id], ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == tokens[: first + 1]
    assert out.outputs[0].finish_reason is FinishReason.STOP and out.outputs[0].stop_reason == stop_id
    # min_tokens masks the stop id until it is reached.
    (late,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=30, min_tokens=first + 3, stop_token_ids=[stop_id], ignore_eos=True), use_tqdm=False)
    assert len(late.outputs[0].token_ids) >= first + 3
    assert stop_id not in late.outputs[0].token_ids[: first + 3]


def test_eos_from_generation_config_stops_unless_ignored(llm, model_dirs, tmp_path):
    free_run = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    tokens = free_run[0].outputs[0].token_ids
    eos = tokens[4]
    # A copy of the model whose generation config names a token greedy decoding reaches.
    model_dir = tmp_path / "model"
    shutil.copytree(model_dirs["llama"], model_dir)
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "eos_token_id": [config["eos_token_id"], eos]}))
    other = LLM(model_dir, dtype="float32", block_size=8, max_num_batched_tokens=64, max_num_seqs=4)
    stopped = other.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == tokens[: tokens.index(eos) + 1]
    assert stopped.finish_reason is FinishReason.STOP
    ignored = other.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert ignored[0].outputs[0].token_ids == tokens
    assert ignored[0].outputs[0].finish_reason is FinishReason.LENGTH
    assert other.engine.kv.num_used_blocks == 0


def test_stream_deltas_add_up_to_generate(llm):
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=30, stop=["zz"], ignore_eos=True)
    expected = llm.generate(PROMPTS, params, use_tqdm=False)
    texts = ["" for _ in PROMPTS]
    tokens = [[] for _ in PROMPTS]
    for event in llm.stream(PROMPTS, params):
        texts[event.prompt_index] += event.delta.text
        tokens[event.prompt_index] += event.delta.token_ids
    assert texts == [o.outputs[0].text for o in expected]
    assert tokens == [o.outputs[0].token_ids for o in expected]
    for text, out in zip(texts, expected):
        if out.outputs[0].stop_reason is None:
            assert text == llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_breaking_out_of_a_stream_aborts_and_frees(llm):
    stream = llm.stream(PROMPTS, SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert llm.engine.kv.num_used_blocks == 0


def test_logprobs_are_the_raw_log_softmax(llm, model_dirs):
    prompt = llm.tokenizer.encode(PROMPTS[0])
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=4, ignore_eos=True), use_tqdm=False)
    first = out.outputs[0].logprobs[0]
    from pdserve.engine.model_loader import load_reference_model

    ref = load_reference_model(model_dirs["llama"], torch.float32)
    with torch.inference_mode():
        logits = ref(torch.tensor([prompt])).logits[0, -1]
    expected = torch.log_softmax(logits.float(), -1).topk(4)
    assert first.top_token_ids == expected.indices.tolist()
    assert first.top_logprobs == pytest.approx(expected.values.tolist(), abs=1e-4)
    assert first.token_logprob == pytest.approx(expected.values[0].item(), abs=1e-4)
    assert len(out.outputs[0].logprobs) == 3


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([], SamplingParams(), "prompt_token_ids"),
        ([10**6], SamplingParams(), "prompt_token_ids"),
        ([1] * 5000, SamplingParams(), "prompt_token_ids"),
    ],
)
def test_requests_that_can_never_run_are_rejected(llm, prompt, params, field):
    with pytest.raises(RequestRejected, match=field):
        llm.engine.add_request("bad", prompt, params)


def test_request_larger_than_the_pool_is_rejected(model_dirs):
    small = LLM(model_dirs["llama"], dtype="float32", block_size=8, num_blocks=4, max_num_batched_tokens=16, max_num_seqs=2)
    with pytest.raises(RequestRejected, match="max_tokens need 5 KV blocks; this engine has 4"):
        small.generate([list(range(1, 30))], SamplingParams(max_tokens=8), use_tqdm=False)
    assert small.engine.kv.num_used_blocks == 0 and not small.engine.has_unfinished()


def test_chat_renders_each_conversation_with_the_chat_template_and_generates_it(llm):
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a block?"}]
    rendered = llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")  # the demo tokenizer's ChatML template
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    one, two = llm.chat([conversation, conversation[1:]], greedy, use_tqdm=False)
    assert one.outputs[0].token_ids == llm.generate([rendered], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert one.prompt == rendered and two.prompt.startswith("<|im_start|>user")
    assert llm.chat(conversation, greedy, use_tqdm=False)[0].outputs[0].token_ids == one.outputs[0].token_ids

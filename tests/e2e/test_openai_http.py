"""The OpenAI-compatible HTTP API of a real cluster (`pdserve cluster`, which serves it beside gRPC),
driven by the official `openai` client:

- completions: float32 greedy text equals transformers' tokens decoded, streamed or not, for
  token-id prompts and several prompts in one request; usage counts are exact;
- chat: the demo tokenizer's chat template renders the messages; streamed content equals the
  whole answer; logprobs with top_logprobs; n > 1 with a seed is reproducible;
- stop strings cut the text; a bad field is 400 naming it; an unknown model is 404;
- a client that leaves mid-stream frees every block on every node.
"""

from __future__ import annotations

import random

import openai
import pytest
import torch
from transformers import AutoTokenizer

from pdserve.engine.model_loader import load_reference_model
from tests.e2e.cluster import NodeSettings, assert_every_block_free, running_cluster
from tests.integration.reference import greedy_references

PROMPT_LENS = [3, 17, 40]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return str(tiny_model)


@pytest.fixture(scope="module")
def cluster(model_dir):
    with running_cluster(model_dir, 1, 1, NodeSettings()) as running:
        yield running


@pytest.fixture(autouse=True)
def no_blocks_left(cluster):
    """Every test ends with no block used or reserved on any node."""
    yield
    assert_every_block_free(cluster)


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.state.http, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def test_greedy_completions_equal_transformers_streamed_or_not(client, model_dir, tokenizer):
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 900) for _ in range(n)] for n in PROMPT_LENS]
    expected = [tokenizer.decode(r.token_ids) for r in greedy_references(model_dir, prompts, [NEW_TOKENS] * 3)]
    whole = client.completions.create(model="tiny", prompt=prompts, max_tokens=NEW_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == expected
    assert whole.usage.prompt_tokens == sum(PROMPT_LENS) and whole.usage.completion_tokens == 3 * NEW_TOKENS
    stream = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=NEW_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[1]
    assert chunks[-1].usage.completion_tokens == NEW_TOKENS and chunks[-1].usage.prompt_tokens == PROMPT_LENS[1]


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client, model_dir, tokenizer):
    prompt = [random.Random(3).randrange(1, 900) for _ in range(20)]
    model = load_reference_model(model_dir, torch.float32)
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                      logprobs=2, extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    (reference,) = greedy_references(model_dir, [prompt], [4])
    assert choice.text == tokenizer.decode(prompt) + tokenizer.decode(reference.token_ids)
    scores = choice.logprobs
    assert len(scores.tokens) == len(prompt) + 4 and scores.token_logprobs[0] is None
    got = torch.tensor(scores.token_logprobs[1:len(prompt)])
    want = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(got, want, atol=1e-5)
    assert all(len(top) == 2 for top in scores.top_logprobs[1:])
    # vLLM's `prompt_logprobs`: None, then per prompt token a map with the token's own entry.
    asked = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body={"ignore_eos": True, "prompt_logprobs": 1})
    rows = asked.choices[0].model_extra["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(prompt)
    assert [row[str(t)]["logprob"] for row, t in zip(rows[1:], prompt[1:])] == pytest.approx(want.tolist(), abs=1e-5)


def test_chat_renders_the_template_and_streams_the_same_answer(client, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a cache?"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                           logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    answer = whole.choices[0].message
    assert answer.role == "assistant" and whole.usage.prompt_tokens == len(tokenizer.encode(rendered))
    assert len(whole.choices[0].logprobs.content) == whole.usage.completion_tokens == 10
    assert all(len(t.top_logprobs) == 2 for t in whole.choices[0].logprobs.content)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.content


def test_seeded_samples_are_reproducible_and_stop_strings_cut(client):
    ask = dict(model="tiny", prompt="the cache", max_tokens=16, temperature=1.0, n=3, seed=7,
               extra_body={"ignore_eos": True})
    first, again = client.completions.create(**ask), client.completions.create(**ask)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    text = client.completions.create(model="tiny", prompt="the cache", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = text[4:7]
    cut = client.completions.create(model="tiny", prompt="the cache", max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == text[:text.index(stop)] and cut.finish_reason == "stop"


def test_bad_fields_and_unknown_models_are_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="x", max_tokens=4, top_p=7)
    assert bad.value.body["param"] == "top_p" and "top_p" in bad.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=4)
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_a_client_leaving_mid_stream_frees_every_block(client, cluster):
    stream = client.completions.create(model="tiny", prompt="a long one", max_tokens=1500, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for count, _ in enumerate(stream):
        if count == 5:
            break
    stream.close()
    held = cluster.wait_all_blocks_free(timeout_s=30)
    assert [(s.used_blocks, s.reserved_blocks) for s in held] == [(0, 0), (0, 0)]

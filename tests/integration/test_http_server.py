"""The OpenAI-compatible HTTP server, driven by the real ``openai`` package (and httpx for
what it would not send): answers, streaming, sampling features, errors, metrics, and what
a client that leaves mid-stream gives back.

The shared ``http_engine`` serves the embedded text model with an API key and a chat
template (the tokenizer has none); ``http_tiny_engine`` serves random:qwen2-tiny (no
tokenizer) from two server processes.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from cbpipe.client import Client
from tests.integration.conftest import (
    CHAT_TEMPLATE,
    HTTP_API_KEY,
    HTTP_MODEL_NAME,
    MODEL_FLAGS,
    POOL_READY_TIMEOUT_S,
    TEXT_MODEL_DIR,
    VOCAB_SIZE,
    EngineRun,
)
from tests.integration.helpers import RESULT_TIMEOUT_S

PROMPTS = ["Return the", "The list of", "Raise"]
MODEL = HTTP_MODEL_NAME


@pytest.fixture(scope="module")
def tiny_api(http_tiny_engine: EngineRun) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=http_tiny_engine.http_url + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=RESULT_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def hf() -> Any:
    """The text model in transformers, float32 on the CPU: the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(TEXT_MODEL_DIR, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(TEXT_MODEL_DIR)


def hf_greedy(hf: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model, _ = hf
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()


def hf_logprobs(hf: Any, token_ids: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits after each position: ``[len, vocab]``."""
    model, _ = hf
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def encode(hf: Any, text: str) -> list[int]:
    return list(hf[1](text, add_special_tokens=False).input_ids)


# --- answers ---------------------------------------------------------------------------


def test_models_lists_the_served_model(api: openai.OpenAI) -> None:
    models = api.models.list().data
    assert [m.id for m in models] == [MODEL]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_equals_transformers(api: openai.OpenAI, hf: Any, prompt: str) -> None:
    prompt_ids = encode(hf, prompt)
    expected = hf_greedy(hf, prompt_ids, 24)
    reply = api.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    (choice,) = reply.choices
    assert choice.model_extra is not None
    assert choice.model_extra["token_ids"] == expected
    assert choice.text == hf[1].decode(expected, skip_special_tokens=True)
    assert choice.finish_reason == ("stop" if len(expected) < 24 else "length")
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
        len(prompt_ids),
        len(expected),
    )


def test_token_id_prompts_and_a_batch_of_prompts(api: openai.OpenAI, hf: Any) -> None:
    ids = [encode(hf, p) for p in PROMPTS]
    reply = api.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice, prompt_ids in zip(reply.choices, ids, strict=True):
        assert choice.text == hf[1].decode(hf_greedy(hf, prompt_ids, 10), skip_special_tokens=True)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == sum(map(len, ids))


def test_streamed_completion_is_the_completion(api: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "prompt": PROMPTS[1],
        "max_tokens": 30,
        "temperature": 0,
        "extra_body": {"return_token_ids": True},
    }
    whole = api.completions.create(**kwargs).choices[0]
    chunks = list(
        api.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    parts = [c.choices[0] for c in chunks[:-1]]
    assert "".join(p.text for p in parts) == whole.text
    assert [t for p in parts for t in p.model_extra["token_ids"]] == whole.model_extra["token_ids"]
    assert parts[-1].finish_reason == whole.finish_reason
    assert all(p.finish_reason is None for p in parts[:-1])
    assert usage.completion_tokens == len(whole.model_extra["token_ids"])


def test_chat_uses_the_chat_template(api: openai.OpenAI, hf: Any) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TEXT_MODEL_DIR)
    tokenizer.chat_template = CHAT_TEMPLATE.read_text()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = encode(hf, rendered)
    expected = hf_greedy(hf, prompt_ids, 16)

    reply = api.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0,  # type: ignore[arg-type]
    )
    (choice,) = reply.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt_ids)

    stream = api.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=16, temperature=0,  # type: ignore[arg-type]
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_a_reply_sent_back_as_the_openai_package_gives_it_continues_the_chat(
    api: openai.OpenAI, http: httpx.Client
) -> None:
    """The usual loop appends ``reply.choices[0].message``: the package's model of it, with
    every field of OpenAI's assistant message (``refusal``, ``audio``, ``function_call``,
    ``annotations``) whether null or not. The template sees the same conversation as the
    plain one."""
    messages: list[Any] = [{"role": "user", "content": "Hello"}]
    first = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                        temperature=0)  # type: ignore[arg-type]  # fmt: skip
    sent_back = first.choices[0].message.model_dump()
    assert {"refusal", "audio", "function_call", "annotations"} <= set(sent_back)
    conversation = [*messages, sent_back, {"role": "user", "content": "And?"}]
    second = api.chat.completions.create(model=MODEL, messages=conversation, max_tokens=4,
                                         temperature=0)  # fmt: skip
    plain = [*messages, {"role": "assistant", "content": sent_back["content"]},
             {"role": "user", "content": "And?"}]  # fmt: skip
    counted = http.post("/tokenize", json={"messages": plain}).json()["count"]
    assert second.usage is not None and second.usage.prompt_tokens == counted


def test_tokenize_counts_what_the_generation_endpoints_send(
    api: openai.OpenAI, http: httpx.Client, hf: Any
) -> None:
    prompt = "The list of the values"
    reply = http.post(
        "/tokenize", json={"model": MODEL, "prompt": prompt, "return_token_strs": True}
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["tokens"] == encode(hf, prompt) and body["count"] == len(body["tokens"])
    assert body["token_strs"] == hf[1].convert_ids_to_tokens(body["tokens"])
    assert body["max_model_len"] == api.models.list().data[0].model_extra["max_model_len"]
    usage = api.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage
    assert usage is not None and usage.prompt_tokens == body["count"]
    with_bos = http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": True}).json()
    expected = list(hf[1](prompt, add_special_tokens=True).input_ids)
    assert with_bos["tokens"] == expected
    usage = api.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, extra_body={"add_special_tokens": True}
    ).usage
    assert usage is not None and usage.prompt_tokens == len(expected)

    messages = [{"role": "user", "content": "Hello"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    reply = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert reply.usage is not None and chat["count"] == reply.usage.prompt_tokens

    text = http.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]}).json()
    assert text == {"prompt": prompt}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                       "add_special_tokens": True}, "messages"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
        ("/detokenize", {}, "tokens"),
    ],
)  # fmt: skip
def test_bad_tokenize_requests_are_400s(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == param


def test_tokenize_without_a_tokenizer_is_a_400(http_tiny_engine: EngineRun) -> None:
    with httpx.Client(base_url=http_tiny_engine.http_url) as bare:
        for path, body in [("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})]:
            response = bare.post(path, json=body)
            assert response.status_code == 400, response.text
            assert "no tokenizer" in error_of(response)["message"]


def test_seeded_samples_repeat_and_n_samples_differ(api: openai.OpenAI) -> None:
    def sample(seed: int, n: int = 1) -> list[str]:
        reply = api.completions.create(
            model=MODEL, prompt="The list of", max_tokens=20, temperature=1.0, seed=seed,
            n=n, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert [c.index for c in reply.choices] == list(range(n))
        return [c.text for c in reply.choices]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    four = sample(7, n=4)
    assert four == sample(7, n=4)
    assert len(set(four)) > 1


def test_n_samples_stream_under_their_indices(api: openai.OpenAI) -> None:
    chunks = list(
        api.completions.create(
            model=MODEL, prompt=["Return the", "Raise"], max_tokens=8, temperature=1.0,
            seed=3, n=2, stream=True, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    finished: dict[int, int] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                finished[choice.index] = finished.get(choice.index, 0) + 1
    assert finished == {0: 1, 1: 1, 2: 1, 3: 1}


def test_stop_strings_end_the_text_before_them(api: openai.OpenAI) -> None:
    base = api.completions.create(
        model=MODEL, prompt="Return the", max_tokens=40, temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0].text  # fmt: skip
    words = base.split()
    assert len(words) > 3, base
    stop = " " + words[2]
    cut = base[: base.index(stop)]
    reply = api.completions.create(
        model=MODEL, prompt="Return the", max_tokens=40, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.choices[0].text == cut
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].model_extra["stop_reason"] == stop  # type: ignore[index]
    streamed = list(api.completions.create(
        model=MODEL, prompt="Return the", max_tokens=40, temperature=0, stop=stop,
        stream=True, extra_body={"ignore_eos": True},
    ))  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == cut
    # vLLM's stop_reason in every chunk: null until the one that finishes
    reasons = [c.choices[0].model_extra["stop_reason"] for c in streamed]  # type: ignore[index]
    assert reasons == [None] * (len(streamed) - 1) + [stop]
    messages = [{"role": "user", "content": "Return the"}]
    said = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    ).choices[0].message.content  # fmt: skip
    assert said and len(said) > 8, said
    chat_stop = said[6:8]  # some text of the reply (the embedded model's is not prose)
    chat = list(api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0,  # type: ignore[arg-type]
        stop=[chat_stop], stream=True, extra_body={"ignore_eos": True},
    ))  # fmt: skip
    last = chat[-1].choices[0]
    assert (last.finish_reason, last.model_extra["stop_reason"]) == ("stop", chat_stop)  # type: ignore[index]


def test_stop_strings_and_special_tokens_kept_in_the_text_on_request(
    api: openai.OpenAI, hf: Any
) -> None:
    """vLLM's ``include_stop_str_in_output`` keeps the stop string (and the stop token's
    text), ``skip_special_tokens: false`` the special tokens' text."""
    base = api.completions.create(
        model=MODEL, prompt="Return the", max_tokens=40, temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0].text  # fmt: skip
    stop = " " + base.split()[2]
    kept = base[: base.index(stop) + len(stop)]
    for stream in (False, True):
        reply = api.completions.create(
            model=MODEL, prompt="Return the", max_tokens=40, temperature=0, stop=[stop],
            stream=stream, extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
        )  # fmt: skip
        chunks = list(reply) if stream else [reply]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == kept
    # The end-of-sequence token, forced by a bias: its text only when specials are kept,
    # and when it ends the sample only with the stop text included.
    eos = hf[1].eos_token_id
    eos_text = hf[1].decode([eos], skip_special_tokens=False)
    forced = {"logit_bias": {str(eos): 100}}
    for extra, text in (
        ({"ignore_eos": True}, ""),
        ({"ignore_eos": True, "skip_special_tokens": False}, eos_text * 3),
        ({"skip_special_tokens": False}, ""),
        ({"skip_special_tokens": False, "include_stop_str_in_output": True}, eos_text),
    ):
        choice = api.completions.create(
            model=MODEL, prompt="Return the", max_tokens=3, temperature=0,
            extra_body=forced | extra,
        ).choices[0]  # fmt: skip
        assert choice.text == text, extra


def test_logprobs_are_the_models(api: openai.OpenAI, hf: Any) -> None:
    prompt_ids = encode(hf, "The list of")
    reply = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "The list of"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = reply.choices[0]
    generated = choice.model_extra["token_ids"]  # type: ignore[index]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == len(generated)
    # The completions API: the same tokens' log-probabilities, against transformers'.
    completion = api.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=6, temperature=0, logprobs=2,
        extra_body={"return_token_ids": True},
    ).choices[0]  # fmt: skip
    ids = completion.model_extra["token_ids"]  # type: ignore[index]
    reference = hf_logprobs(hf, prompt_ids + ids)
    assert completion.logprobs is not None and completion.logprobs.token_logprobs is not None
    for i, (token_id, logprob) in enumerate(
        zip(ids, completion.logprobs.token_logprobs, strict=True)
    ):
        expected = reference[len(prompt_ids) - 1 + i, token_id].item()
        assert math.isclose(logprob, expected, abs_tol=1e-3), (i, logprob, expected)
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 3
        assert entry.bytes == list(entry.token.encode())


def test_top_logprobs_are_the_most_likely_tokens(api: openai.OpenAI, hf: Any) -> None:
    prompt_ids = encode(hf, "The list of")
    choice = api.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=4, temperature=0, logprobs=3,
        extra_body={"return_token_ids": True},
    ).choices[0]  # fmt: skip
    ids = choice.model_extra["token_ids"]  # type: ignore[index]
    reference = hf_logprobs(hf, prompt_ids + ids)
    assert choice.logprobs is not None and choice.logprobs.top_logprobs is not None
    for i, top in enumerate(choice.logprobs.top_logprobs):
        expected = torch.topk(reference[len(prompt_ids) - 1 + i], 3)
        pairs = zip(expected.indices.tolist(), expected.values.tolist(), strict=True)
        want = {hf[1].decode([t]): v for t, v in pairs}
        assert set(top) == set(want), (i, top, want)
        for token, logprob in want.items():
            assert math.isclose(top[token], logprob, abs_tol=1e-3), (i, token)


def test_echo_with_prompt_logprobs_equal_transformers(api: openai.OpenAI, hf: Any) -> None:
    prompt = "The list of the values"
    prompt_ids = encode(hf, prompt)
    reply = api.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1,
        extra_body={"return_token_ids": True},
    ).choices[0]  # fmt: skip
    assert reply.text.startswith(prompt)
    assert reply.logprobs is not None and reply.logprobs.token_logprobs is not None
    logprobs = reply.logprobs.token_logprobs
    generated = reply.model_extra["token_ids"]  # type: ignore[index]
    assert len(logprobs) == len(prompt_ids) + len(generated)
    assert logprobs[0] is None
    reference = hf_logprobs(hf, prompt_ids)
    for i in range(1, len(prompt_ids)):
        expected = reference[i - 1, prompt_ids[i]].item()
        assert math.isclose(logprobs[i], expected, abs_tol=1e-3), (i, logprobs[i], expected)
    # Each token's offset in the choice's text, the echoed prompt's included.
    tokens, offsets = reply.logprobs.tokens, reply.logprobs.text_offset
    assert tokens is not None and "".join(tokens) == reply.text
    assert offsets == list(itertools.accumulate([0, *map(len, tokens[:-1])]))
    streamed = api.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1,
        stream=True,
    )  # fmt: skip
    chunks = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens or []] == tokens
    assert [o for c in chunks for o in c.text_offset or []] == offsets


def test_max_tokens_0_with_echo_scores_the_prompt(api: openai.OpenAI, hf: Any) -> None:
    """Legacy scoring (lm-evaluation-harness's loglikelihood over a completions API): the
    prompt back with its log-probabilities, nothing generated, in a reply and a stream."""
    prompt = "The list of the values"
    prompt_ids = encode(hf, prompt)
    reference = hf_logprobs(hf, prompt_ids)
    expected = [None] + [reference[i - 1, prompt_ids[i]].item() for i in range(1, len(prompt_ids))]
    reply = api.completions.create(model=MODEL, prompt=[prompt, prompt], max_tokens=0,
                                   echo=True, logprobs=1, n=2)  # fmt: skip
    assert len(reply.choices) == 4
    for choice in reply.choices:
        assert choice.text == prompt and choice.finish_reason == "length"
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        scored = choice.logprobs.token_logprobs
        assert len(scored) == len(prompt_ids) and scored[0] is None
        pairs = zip(scored[1:], expected[1:], strict=True)
        assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in pairs), (scored, expected)
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (2 * len(prompt_ids), 0)
    streamed = list(api.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    choices = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in choices) == prompt
    assert choices[-1].finish_reason == "length"
    assert streamed[-1].usage is not None and streamed[-1].usage.completion_tokens == 0


def test_penalties_change_greedy_output_as_transformers_does(api: openai.OpenAI, hf: Any) -> None:
    prompt_ids = encode(hf, "The list of")
    model, _ = hf
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False,
            repetition_penalty=1.5, attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )  # fmt: skip
    expected = out[0, len(prompt_ids) :].tolist()
    reply = api.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=24, temperature=0,
        extra_body={"repetition_penalty": 1.5, "return_token_ids": True},
    )  # fmt: skip
    assert reply.choices[0].model_extra["token_ids"] == expected  # type: ignore[index]
    plain = api.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=24, temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0].text  # fmt: skip
    penalised = [
        api.completions.create(
            model=MODEL, prompt=prompt_ids, max_tokens=24, temperature=0,
            frequency_penalty=1.5, presence_penalty=1.0, extra_body={"ignore_eos": True},
        ).choices[0].text
        for _ in range(2)
    ]  # fmt: skip
    assert penalised[0] == penalised[1] != plain


def test_no_tokenizer_takes_token_ids_and_answers_with_them(tiny_api: openai.OpenAI) -> None:
    reply = tiny_api.completions.create(
        model="random:qwen2-tiny", prompt=[5, 6, 7], max_tokens=8, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.text == ""
    ids = choice.model_extra["token_ids"]  # type: ignore[index]
    assert len(ids) == 8 and all(0 <= t < VOCAB_SIZE for t in ids)
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert choice.logprobs.text_offset == [0] * len(ids)  # into the text, which is empty
    with pytest.raises(openai.BadRequestError, match="no tokenizer"):
        tiny_api.completions.create(model="random:qwen2-tiny", prompt="text", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="no tokenizer"):
        tiny_api.chat.completions.create(
            model="random:qwen2-tiny", messages=[{"role": "user", "content": "hi"}]
        )


# --- errors --------------------------------------------------------------------------------


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10**6}, "max_tokens"),  # past the model's length
        ({"prompt": [[5, 6]] * 17, "n": 128}, "prompt"),  # 2176 choices: over MAX_CHOICES
        ({"prompt": "x", "temperature": -1.0}, "temperature"),
        ({"prompt": "x", "top_p": "high"}, "top_p"),
        ({"prompt": "x", "echo": 1}, "echo"),
        ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "cache_salt": 7}, "cache_salt"),
        ({"prompt": "x", "cache_salt": "s" * 257}, "cache_salt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [10**6]}, "prompt"),
        ({}, "prompt"),
    ],
)
def test_bad_completion_requests_are_400s(
    http: httpx.Client, body: dict[str, Any], param: str
) -> None:
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}], "functions": []}, "functions"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function",
          "function": {"name": "f"}}]}, "tool_choice"),  # no --enable-auto-tool-choice
        ({"messages": [{"role": "user", "content": "x"}],
          "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6},
         "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"},
                       {"role": "assistant", "content": "y", "audio": {"id": "a"}}]},
         "messages[1].audio"),
        ({"messages": [{"role": "user", "content": "x"},
                       {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}]},
         "messages[1].function_call"),
    ],
)  # fmt: skip
def test_bad_chat_requests_are_400s(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == param


def test_top_logprobs_of_0_without_logprobs_asks_for_nothing(http: httpx.Client) -> None:
    """vLLM accepts it (only a positive count needs ``logprobs: true``); clients send it."""
    body = {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 0, "max_tokens": 2}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"] is None


def test_max_tokens_that_would_pass_the_models_length_is_a_400_saying_so(
    http: httpx.Client,
) -> None:
    model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    prompt = [5] * (model_len - 3)
    response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
    assert response.status_code == 400, response.text
    message = error_of(response)["message"]
    assert f"maximum context length is {model_len} tokens" in message
    assert f"{model_len - 3} input tokens" in message
    # What fits is served, and a default is cut to fit rather than refused.
    for body in ({"max_tokens": 3}, {}):
        reply = http.post("/v1/completions", json={"prompt": prompt, "ignore_eos": True, **body,
                                                   "return_token_ids": True})  # fmt: skip
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["choices"][0]["token_ids"]) == 3


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi \ud800 there"}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "stop": ["\udfff"]}, "stop"),
        ("/v1/completions", {"prompt": "x", "metadata": {"\ud800": "k"}}, "metadata"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]},
         "messages[0].content"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
         "messages[0].content"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_is_a_400_and_the_connection_serves_on(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    # json.dumps writes the lone surrogate as a \u escape, as a JavaScript client that cut
    # an emoji in half sends it: valid JSON that is not text.
    response = http.post(path, content=json.dumps(body).encode(),
                         headers={"content-type": "application/json"})  # fmt: skip
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param and "surrogate" in error["message"], error
    assert http.post("/tokenize", json={"prompt": "still here"}).status_code == 200


def test_bad_json_is_a_400(http: httpx.Client) -> None:
    for content in (b'{"prompt": "x"', b"[1, 2]", b"not json at all"):
        response = http.post("/v1/completions", content=content,
                             headers={"content-type": "application/json"})  # fmt: skip
        assert response.status_code == 400, response.text
        error_of(response)


def _read_reply(conn: Any) -> str:
    """One whole HTTP reply: the headers and the body may arrive in separate segments."""
    data = b""
    while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
         if line.lower().startswith(b"content-length:")),
        0,
    )  # fmt: skip
    while len(body) < length and (chunk := conn.recv(65536)):
        body += chunk
    return (head + b"\r\n\r\n" + body).decode()


def test_a_body_too_large_is_a_413_before_it_is_read(http_engine: EngineRun) -> None:
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(http_engine.http_url)
    with socket.create_connection((url.hostname, url.port), timeout=RESULT_TIMEOUT_S) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000000000\r\n\r\n{"
        )
        reply = _read_reply(conn)
    assert reply.startswith("HTTP/1.1 413"), reply
    assert '"type":"invalid_request_error"' in reply


def test_the_openai_client_sees_each_error_status(
    api: openai.OpenAI, http_engine: EngineRun
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        api.completions.create(model=MODEL, prompt="x", suffix="y")
    assert bad.value.param == "suffix"
    with pytest.raises(openai.NotFoundError) as missing:
        api.completions.create(model="gpt-4", prompt="x")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="too long"):
        api.completions.create(model=MODEL, prompt=[5] * 2100, max_tokens=4)
    keyless = openai.OpenAI(base_url=http_engine.http_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        keyless.models.list()
    with pytest.raises(openai.AuthenticationError):
        keyless.completions.create(model=MODEL, prompt="x")


def test_health_metrics_and_version_need_no_key_and_unknown_paths_are_404s(
    http_engine: EngineRun,
) -> None:
    with httpx.Client(base_url=http_engine.http_url) as bare:
        assert bare.get("/health").status_code == 200
        assert bare.get("/metrics").status_code == 200
        assert bare.get("/version").json()["version"] == importlib.metadata.version("cbpipe")
        assert bare.post("/tokenize", json={"prompt": "x"}).status_code == 401
        assert bare.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        response = bare.get("/v2/nothing")
        assert response.status_code == 404
        error_of(response)


# --- streams that end early, and streams that go on --------------------------------------


def wait_until_idle(address: str) -> Any:
    """The engine's stats once nothing runs or waits (bounded: a leak fails the test)."""
    with Client(address) as client:
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while True:
            stats = client.stats()
            if stats.num_running == stats.num_waiting == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_that_leaves_mid_stream_frees_its_blocks(
    http_engine: EngineRun, endpoint: str
) -> None:
    body: dict[str, Any] = {"max_tokens": 1800, "stream": True, "ignore_eos": True}
    if endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Tell me"}]
    else:
        body["prompt"] = "Tell me"
    headers = {"Authorization": f"Bearer {HTTP_API_KEY}"}
    cancelled = "cbpipe:request_success_total{finished_reason=cancelled}"
    before = scrape(http_engine.http_url)
    with (
        httpx.Client(base_url=http_engine.http_url, headers=headers, timeout=60) as leaver,
        leaver.stream("POST", endpoint, json=body) as response,
    ):
        assert response.status_code == 200
        events = 0
        with Client(http_engine.address) as client:
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    assert client.stats().num_running == 1
                    break  # closing the line iterator closes the connection: httpx's way
    stats = wait_until_idle(http_engine.address)
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.kv_cache_usage == 0.0
    assert scrape(http_engine.http_url).get(cancelled, 0) - before.get(cancelled, 0) == 1


def test_a_client_that_gives_up_on_a_reply_frees_its_blocks(http_engine: EngineRun) -> None:
    body = {"prompt": "Tell me", "max_tokens": 1800, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {HTTP_API_KEY}"}
    cancelled = "cbpipe:request_success_total{finished_reason=cancelled}"
    before_metrics = scrape(http_engine.http_url)
    with Client(http_engine.address) as client:
        before = client.stats().num_generation_tokens
        with pytest.raises(httpx.ReadTimeout):  # gives up long before 1800 tokens
            httpx.post(http_engine.http_url + "/v1/completions", json=body, headers=headers,
                       timeout=httpx.Timeout(60, read=0.5))  # fmt: skip
    stats = wait_until_idle(http_engine.address)
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert 0 < stats.num_generation_tokens - before < 1800  # cancelled, not run to its end
    after_metrics = scrape(http_engine.http_url)  # and counted so
    assert after_metrics.get(cancelled, 0) - before_metrics.get(cancelled, 0) == 1


def test_bad_requests_leave_a_running_stream_alone(
    http_engine: EngineRun, http: httpx.Client
) -> None:
    body = {"prompt": "Once upon", "max_tokens": 200, "stream": True, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True}  # fmt: skip
    tokens: list[int] = []
    with http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        bad_sent = False
        for line in lines:
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            tokens += json.loads(line[6:])["choices"][0]["token_ids"]
            if len(tokens) >= 5 and not bad_sent:
                bad_sent = True
                for content in (b'{"prompt":', b'{"prompt": 5}', b'{"prompt": "x", "n": "2"}'):
                    response = http.post("/v1/completions", content=content,
                                         headers={"content-type": "application/json"})  # fmt: skip
                    assert response.status_code == 400
    assert bad_sent and len(tokens) == 200


# --- metrics --------------------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed by name and labels (model_name left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(labels.items()))
            samples[key] = sample.value
    return samples


def test_metrics_count_the_requests_of_both_server_processes(
    http_tiny_engine: EngineRun, tiny_api: openai.OpenAI
) -> None:
    assert (
        len([k for k in http_tiny_engine.engine.ready_fields if k.startswith("api_server_")]) == 2
    )
    before = scrape(http_tiny_engine.http_url)
    prompt_tokens = completion_tokens = 0
    lengths = [3, 5, 8, 13, 2, 7]
    for i, n in enumerate(lengths):  # fresh connections: the kernel spreads them
        with openai.OpenAI(base_url=http_tiny_engine.http_url + "/v1", api_key="x",
                           max_retries=0) as fresh:  # fmt: skip
            reply = fresh.completions.create(
                model="random:qwen2-tiny", prompt=[5 + i] * (i + 2), max_tokens=n, temperature=0,
                stream=i % 2 == 1, extra_body={"ignore_eos": True},
                **({"stream_options": {"include_usage": True}} if i % 2 else {}),
            )  # fmt: skip
            usage = list(reply)[-1].usage if i % 2 else reply.usage  # type: ignore[union-attr, arg-type]
            prompt_tokens += usage.prompt_tokens
            completion_tokens += usage.completion_tokens
    after = scrape(http_tiny_engine.http_url)

    def grew(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert completion_tokens == sum(lengths)
    assert grew("cbpipe:prompt_tokens_total") == prompt_tokens
    assert grew("cbpipe:generation_tokens_total") == completion_tokens
    assert grew("cbpipe:request_success_total{finished_reason=length}") == len(lengths)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):  # fmt: skip
        assert grew(f"cbpipe:{name}_count") == len(lengths), name
    assert grew("cbpipe:inter_token_latency_seconds_count") == completion_tokens - len(lengths)
    assert after["cbpipe:num_requests_running"] == 0
    assert after["cbpipe:num_requests_waiting"] == 0
    assert after["cbpipe:kv_cache_usage_perc"] == 0


def test_metrics_show_the_prefix_cache_serving_a_repeated_prompt(
    http_tiny_engine: EngineRun, tiny_api: openai.OpenAI
) -> None:
    prompt = random.Random(42).choices(range(3, 500), k=40)  # two full blocks of 16 to reuse
    before = scrape(http_tiny_engine.http_url)
    for _ in range(2):
        tiny_api.completions.create(model="random:qwen2-tiny", prompt=prompt, max_tokens=2)
    after = scrape(http_tiny_engine.http_url)
    assert after["cbpipe:prefix_cache_queries"] - before["cbpipe:prefix_cache_queries"] == 80
    assert after["cbpipe:prefix_cache_hits"] - before["cbpipe:prefix_cache_hits"] == 32


def test_usage_counts_the_prompt_tokens_the_cache_served(tiny_api: openai.OpenAI) -> None:
    prompt = random.Random(44).choices(range(3, 500), k=40)  # two full blocks of 16 to reuse

    def cached(**fields: Any) -> int | None:
        reply = tiny_api.completions.create(
            model="random:qwen2-tiny", prompt=prompt, max_tokens=2, **fields
        )
        if fields.get("stream"):
            *_, last = reply
            reply = last
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached() == 0
    assert cached() == 32
    assert cached(stream=True, stream_options={"include_usage": True}) == 32
    # Each prompt counts once: the least of its samples' (here all found the blocks).
    assert cached(n=3, temperature=1.0) == 32


def test_a_cache_salt_keeps_cached_prompts_private(
    http_tiny_engine: EngineRun, tiny_api: openai.OpenAI
) -> None:
    prompt = random.Random(43).choices(range(3, 500), k=40)

    def hits_of(salt: str) -> float:
        before = scrape(http_tiny_engine.http_url)["cbpipe:prefix_cache_hits"]
        tiny_api.completions.create(model="random:qwen2-tiny", prompt=prompt, max_tokens=1,
                                    extra_body={"cache_salt": salt})  # fmt: skip
        return scrape(http_tiny_engine.http_url)["cbpipe:prefix_cache_hits"] - before

    assert hits_of("alice") == 0
    assert hits_of("bob") == 0  # the same prompt, another salt: not alice's blocks
    assert hits_of("alice") == 32


# --- the engine goes away ---------------------------------------------------------------------


@pytest.fixture
def fresh_http_engine() -> Iterator[EngineRun]:
    run = EngineRun((*MODEL_FLAGS, "--port", "0"))
    try:
        run.wait_ready(POOL_READY_TIMEOUT_S)
        yield run
        run.finish()
    finally:
        run.discard()


def test_a_dead_engine_is_a_503(fresh_http_engine: EngineRun) -> None:
    import os
    import signal

    url = fresh_http_engine.http_url
    assert httpx.get(url + "/health").status_code == 200
    # Hold the launcher, which would otherwise stop the servers as soon as the scheduler died.
    os.kill(fresh_http_engine.pid, signal.SIGSTOP)
    try:
        os.kill(fresh_http_engine.engine.scheduler_pid, signal.SIGKILL)
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while (health := httpx.get(url + "/health")).status_code == 200:
            assert time.monotonic() < deadline, "still healthy"
            time.sleep(0.05)
        assert health.status_code == 503
        error_of(health)
        response = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        assert response.status_code == 503
        assert error_of(response)["type"] == "service_unavailable"
    finally:
        os.kill(fresh_http_engine.pid, signal.SIGCONT)
    assert fresh_http_engine.engine.wait_exit(RESULT_TIMEOUT_S) == 1


def test_a_stopping_server_answers_its_open_requests(fresh_http_engine: EngineRun) -> None:
    """SIGTERM to the launcher while a reply and a stream are open: the reply is a 503, and
    the stream's last event before [DONE] is an error, as when the engine goes away; neither
    is cut."""
    import signal
    import threading

    url = fresh_http_engine.http_url
    model_len = httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"]
    body = {"prompt": [5, 6, 7], "max_tokens": model_len - 3, "ignore_eos": True}
    replies: list[httpx.Response] = []
    waiting = threading.Thread(
        target=lambda: replies.append(
            httpx.post(url + "/v1/completions", json=body, timeout=RESULT_TIMEOUT_S)
        )
    )
    waiting.start()
    events: list[str] = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=RESULT_TIMEOUT_S) as stream:  # fmt: skip
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
            if len(events) == 3:  # both requests are running by now
                fresh_http_engine.engine.send_signal(signal.SIGTERM)
    waiting.join(RESULT_TIMEOUT_S)
    (reply,) = replies
    assert reply.status_code == 503, reply.text
    assert "shutting down" in error_of(reply)["message"]
    assert events[-1] == "[DONE]", events[-3:]
    assert "shutting down" in json.loads(events[-2])["error"]["message"], events[-3:]
    assert fresh_http_engine.engine.wait_exit(RESULT_TIMEOUT_S) == 0


# --- the model's sampling defaults ---------------------------------------------------------


def test_the_models_recommended_sampling_fills_what_a_request_leaves_out(
    tmp_path: Path, hf: Any
) -> None:
    """With greedy and 5 tokens recommended, a bare request is answered greedily with 5 tokens;
    a request's own fields still win."""
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 5})
    )
    flags = ("--model", str(TEXT_MODEL_DIR), "--device", "cpu", "--num-blocks", "128",
             "--port", "0", "--generation-config", str(tmp_path))  # fmt: skip
    run = EngineRun(flags)
    try:
        run.wait_ready(POOL_READY_TIMEOUT_S)
        api = openai.OpenAI(base_url=run.http_url + "/v1", api_key="-", max_retries=0)
        prompt = "The list of"
        bare = api.completions.create(model=str(TEXT_MODEL_DIR), prompt=prompt, seed=1)
        assert bare.usage is not None and bare.usage.completion_tokens == 5
        expected = hf[1].decode(hf_greedy(hf, encode(hf, prompt), 5), skip_special_tokens=True)
        assert bare.choices[0].text == expected
        sampled = api.completions.create(
            model=str(TEXT_MODEL_DIR), prompt=prompt, max_tokens=7, temperature=1.0, n=4, seed=1
        )
        assert sampled.usage is not None and sampled.usage.completion_tokens == 4 * 7
        assert len({c.text for c in sampled.choices}) > 1
        run.finish()
    finally:
        run.discard()

"""Text prompts and ``Result.text`` with a model that has a tokenizer: the embedded default
model, or the checkpoint folder named by ``CBPIPE_TEST_TEXT_MODEL``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cbpipe.client import Client, RequestError
from cbpipe.engine_process import EngineProcess, EngineStartError
from tests.hub_cache import cache_model
from tests.integration.conftest import (
    EMBEDDED_MODEL_DIR,
    TEXT_MODEL_DIR,
    EngineRun,
    launch_engine,
)
from tests.integration.helpers import RESULT_TIMEOUT_S

needs_text_model = pytest.mark.skipif(
    not (TEXT_MODEL_DIR / "config.json").exists(), reason=f"no model in {TEXT_MODEL_DIR}"
)


def test_embedded_model_dir_is_the_packages() -> None:
    """conftest finds the folder without importing ``cbpipe.models`` (and transformers)."""
    from cbpipe.models import EMBEDDED_MODEL_DIR as PACKAGE_DIR

    assert PACKAGE_DIR == EMBEDDED_MODEL_DIR


PROMPTS = ["Once upon a time", "The quick brown fox", "1, 2, 3,"]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TEXT_MODEL_DIR)


@pytest.fixture(scope="module", params=["engine", "client"], ids=["text-by-engine", "text-here"])
def text_client(request: pytest.FixtureRequest, text_engine: EngineRun) -> Iterator[Client]:
    """A client whose jobs' text the engine makes, or one that makes it itself from the
    model's tokenizer (loaded from its folder): every test of text holds for both."""
    tokenizer = TEXT_MODEL_DIR if request.param == "client" else None
    with Client(text_engine.address, tokenizer=tokenizer) as client:
        yield client


@needs_text_model
@pytest.mark.parametrize("prompt", PROMPTS)
def test_text_prompt_matches_its_token_ids(
    text_client: Client, tokenizer: Any, prompt: str
) -> None:
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    from_text = text_client.submit(prompt, max_new_tokens=24).result(timeout=RESULT_TIMEOUT_S)
    from_ids = text_client.submit(prompt_ids, max_new_tokens=24).result(timeout=RESULT_TIMEOUT_S)

    assert from_text.num_prompt_tokens == len(prompt_ids)
    assert from_text.token_ids == from_ids.token_ids
    assert from_text.finish_reason in ("stop", "length")
    assert isinstance(from_text.text, str)
    assert from_text.text == tokenizer.decode(from_text.token_ids, skip_special_tokens=True)
    assert from_ids.text == from_text.text


@needs_text_model
def test_text_prompts_stream_and_batch(text_client: Client, tokenizer: Any) -> None:
    results = text_client.generate(
        PROMPTS, max_new_tokens=16, ignore_eos=True, timeout=RESULT_TIMEOUT_S
    )
    for result in results:
        assert len(result.token_ids) == 16
        assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    job = text_client.submit(PROMPTS[0], max_new_tokens=16, ignore_eos=True)
    assert list(job.stream(timeout=RESULT_TIMEOUT_S)) == results[0].token_ids


@needs_text_model
def test_empty_text_prompt_is_refused(text_client: Client) -> None:
    with pytest.raises(RequestError, match="empty"):
        text_client.submit("", max_new_tokens=4).result(timeout=RESULT_TIMEOUT_S)


@needs_text_model
def test_streamed_text_deltas_add_up_to_the_text(text_client: Client, tokenizer: Any) -> None:
    job = text_client.submit(PROMPTS[1], max_new_tokens=40, ignore_eos=True)
    deltas = list(job.deltas(timeout=RESULT_TIMEOUT_S))
    result = job.result(timeout=RESULT_TIMEOUT_S)
    assert [t for d in deltas for t in d.token_ids] == result.token_ids
    assert "".join(d.text for d in deltas) == result.text
    assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert deltas[-1].finish_reason == "length"


@needs_text_model
def test_a_stop_string_ends_the_job_and_is_not_returned(text_client: Client) -> None:
    reference = text_client.submit(PROMPTS[0], max_new_tokens=48, ignore_eos=True).result(
        timeout=RESULT_TIMEOUT_S
    )
    assert reference.text is not None and len(reference.text) > 12
    # A stop string that starts in the middle of the generated text, spanning tokens.
    stop = reference.text[8:12]
    start = reference.text.index(stop)
    job = text_client.submit(PROMPTS[0], max_new_tokens=48, ignore_eos=True, stop=[stop, "zzzz"])
    streamed = "".join(d.text for d in job.deltas(timeout=RESULT_TIMEOUT_S))
    result = job.result(timeout=RESULT_TIMEOUT_S)
    assert (result.finish_reason, result.stop_reason) == ("stop", stop)
    assert result.text == streamed == reference.text[:start]
    # The tokens go as far as the one that completed the match, and agree with the reference.
    assert result.token_ids == reference.token_ids[: len(result.token_ids)]
    assert len(result.token_ids) < 48


@needs_text_model
def test_min_tokens_holds_off_stop_strings(text_client: Client, tokenizer: Any) -> None:
    """As vLLM: a stop string matches only where it ends in text decoded after the first
    ``min_tokens`` tokens; one completed earlier never ends the job."""
    options: dict[str, Any] = {"max_new_tokens": 24, "ignore_eos": True}
    reference = text_client.submit(PROMPTS[0], **options).result(timeout=RESULT_TIMEOUT_S)
    assert reference.text is not None
    ids = reference.token_ids
    early = len(tokenizer.decode(ids[:2], skip_special_tokens=True))
    stop = reference.text[max(early - 3, 0) : early]  # completed by the 2nd token
    boundary = len(tokenizer.decode(ids[:3], skip_special_tokens=True))
    at = reference.text.find(stop, boundary - len(stop) + 1)
    job = text_client.submit(PROMPTS[0], stop=[stop], min_tokens=3, **options)
    streamed = "".join(d.text for d in job.deltas(timeout=RESULT_TIMEOUT_S))
    result = job.result(timeout=RESULT_TIMEOUT_S)
    if at < 0:
        assert (result.finish_reason, result.stop_reason) == ("length", None)
        assert result.text == streamed == reference.text
    else:
        assert (result.finish_reason, result.stop_reason) == ("stop", stop)
        assert result.text == streamed == reference.text[:at]
    assert result.token_ids == ids[: len(result.token_ids)]


@needs_text_model
def test_stop_reason_is_a_stop_token_and_none_at_eos(text_client: Client, tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    at_eos = text_client.submit(PROMPTS[0], max_new_tokens=8, logit_bias={eos: 100}).result(
        timeout=RESULT_TIMEOUT_S
    )
    assert (at_eos.token_ids, at_eos.finish_reason, at_eos.stop_reason) == ([eos], "stop", None)
    options: dict[str, Any] = {"max_new_tokens": 8, "ignore_eos": True}
    first = text_client.submit(PROMPTS[0], **options).result(timeout=RESULT_TIMEOUT_S)
    stop_id = first.token_ids[0]
    at_stop = text_client.submit(PROMPTS[0], stop_token_ids=[stop_id], **options).result(
        timeout=RESULT_TIMEOUT_S
    )
    assert (at_stop.token_ids, at_stop.finish_reason, at_stop.stop_reason) == (
        [stop_id],
        "stop",
        stop_id,
    )


@needs_text_model
def test_the_stop_token_that_ends_a_job_adds_no_text(text_client: Client, tokenizer: Any) -> None:
    """vLLM's: the stop token that ends a job stays in its tokens, but its text is neither
    returned nor streamed, and completes no stop string (one spanning into its text here)."""
    options: dict[str, Any] = {"max_new_tokens": 24, "ignore_eos": True}
    reference = text_client.submit(PROMPTS[0], **options).result(timeout=RESULT_TIMEOUT_S)
    ids = reference.token_ids

    def text_of(num_tokens: int) -> str:
        return str(tokenizer.decode(ids[:num_tokens], skip_special_tokens=True))

    # A later token, not generated before, that adds two characters or more.
    at = next(
        i
        for i in range(2, len(ids))
        if ids[i] not in ids[:i] and len(text_of(i + 1)) >= len(text_of(i)) + 2
    )
    before = text_of(at)
    stop = text_of(at + 1)[len(before) - 2 : len(before) + 2]
    assert stop not in before
    job = text_client.submit(PROMPTS[0], stop=[stop], stop_token_ids=[ids[at]], **options)
    deltas = list(job.deltas(timeout=RESULT_TIMEOUT_S))
    result = job.result(timeout=RESULT_TIMEOUT_S)
    assert (result.finish_reason, result.stop_reason) == ("stop", ids[at])
    assert result.token_ids == [t for d in deltas for t in d.token_ids] == ids[: at + 1]
    assert result.text == "".join(d.text for d in deltas) == before


@needs_text_model
def test_n_samples_of_one_prompt(text_client: Client) -> None:
    job = text_client.submit(PROMPTS[2], max_new_tokens=12, n=3, temperature=1.0, seed=5)
    results = job.results(timeout=RESULT_TIMEOUT_S)
    assert [r.index for r in results] == [0, 1, 2]
    assert len({tuple(r.token_ids) for r in results}) > 1  # independent samples
    again = text_client.submit(PROMPTS[2], max_new_tokens=12, n=3, temperature=1.0, seed=5)
    assert [r.token_ids for r in again.results(timeout=RESULT_TIMEOUT_S)] == [
        r.token_ids for r in results
    ]  # seeded: the same samples again
    single = text_client.submit(PROMPTS[2], max_new_tokens=12, temperature=1.0, seed=5)
    assert single.result(timeout=RESULT_TIMEOUT_S).token_ids == results[0].token_ids
    with pytest.raises(ValueError, match="results"):
        job.result(timeout=1)
    with pytest.raises(ValueError, match="deltas"):  # the samples' tokens would interleave
        job.stream(timeout=1)


@needs_text_model
def test_text_made_here_is_the_engines_for_every_sample(
    text_engine: EngineRun, tokenizer: Any
) -> None:
    """Samples of one job, one of which a stop string ends (only it is cancelled on the
    engine), some with the stop string kept in the text: the same tokens, text, finish
    reasons and log-probabilities whichever side makes the text."""
    options: dict[str, Any] = {"max_new_tokens": 32, "ignore_eos": True, "temperature": 1.0}
    with (
        Client(text_engine.address) as by_engine,
        Client(text_engine.address, tokenizer=tokenizer) as here,
    ):
        free = by_engine.submit(PROMPTS[2], n=3, seed=11, **options).results(RESULT_TIMEOUT_S)
        text = free[1].text
        assert text is not None and len(text) > 12
        stop = next(
            text[i : i + 3]
            for i in range(6, len(text) - 3)
            if text[i : i + 3] not in ((free[0].text or "") + (free[2].text or ""))
        )
        for include in (False, True):
            asked = {
                "n": 3, "seed": 11, "stop": [stop], "logprobs": 2,
                "include_stop_str_in_output": include, **options,
            }  # fmt: skip
            expected = by_engine.submit(PROMPTS[2], **asked).results(RESULT_TIMEOUT_S)
            job = here.submit(PROMPTS[2], **asked)
            deltas = list(job.deltas(timeout=RESULT_TIMEOUT_S))
            got = job.results(RESULT_TIMEOUT_S)
            assert [(r.finish_reason, r.stop_reason) for r in got] == [
                ("length", None),
                ("stop", stop),
                ("length", None),
            ]
            for mine, theirs in zip(got, expected, strict=True):
                assert (mine.token_ids, mine.text, mine.finish_reason, mine.stop_reason) == (
                    theirs.token_ids,
                    theirs.text,
                    theirs.finish_reason,
                    theirs.stop_reason,
                )
                assert (mine.logprobs, mine.top_logprobs) == (theirs.logprobs, theirs.top_logprobs)
                streamed = [d for d in deltas if d.index == mine.index]
                assert "".join(d.text for d in streamed) == mine.text
                assert [t for d in streamed for t in d.token_ids] == mine.token_ids


@needs_text_model
def test_a_stop_string_found_here_stops_the_sample_on_the_engine(
    text_engine: EngineRun, tokenizer: Any
) -> None:
    """The engine hears of a stop string found by the client as a cancel: it stops a few
    tokens after the match, not at the job's length limit."""
    with Client(text_engine.address, tokenizer=tokenizer) as client:
        options: dict[str, Any] = {"max_new_tokens": 48, "ignore_eos": True}
        reference = client.submit(PROMPTS[0], **options).result(timeout=RESULT_TIMEOUT_S)
        assert reference.text is not None and len(reference.text) > 12
        stop = reference.text[8:12]
        before = client.stats().num_generation_tokens
        long = {**options, "max_new_tokens": 1000}
        result = client.submit(PROMPTS[0], stop=[stop], **long).result(timeout=RESULT_TIMEOUT_S)
        made = client.stats().num_generation_tokens - before
    assert (result.finish_reason, result.stop_reason) == ("stop", stop)
    assert result.token_ids == reference.token_ids[: len(result.token_ids)]
    # Some steps past the match (the engine pipelines ahead, and on a loaded machine the
    # client may take a while to answer), but far short of the length limit of 1000.
    assert len(result.token_ids) <= made <= len(result.token_ids) + 300


@needs_text_model
def test_the_default_log_level_is_quiet() -> None:
    """Start-up (weights loaded from a checkpoint), a job and a clean stop print nothing but
    the ready line: no progress bar, no library's chatter."""
    flags = ["--model", str(TEXT_MODEL_DIR), "--device", "cpu", "--num-blocks", "64"]
    with EngineProcess.start(flags) as engine:
        with Client(engine.address) as client:
            assert client.submit(PROMPTS[0], max_new_tokens=4).result(RESULT_TIMEOUT_S).text
        assert engine.stop() == 0
        assert engine.stderr == ""


def test_a_model_named_by_its_hub_id_serves_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every process finds the snapshot in the cache, offline; the id is the model's name."""
    import torch
    from transformers import AutoModelForCausalLM

    cache_model(tmp_path, "acme/tiny", sorted(EMBEDDED_MODEL_DIR.iterdir()))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompt = [100, 200, 300, 400]  # eight tokens before any EOS
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, dtype=torch.float32)
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )[0, len(prompt) :].tolist()  # fmt: skip
    flags = ["--model", "acme/tiny", "--device", "cpu", "--num-blocks", "64"]
    with EngineProcess.start(flags) as engine, Client(engine.address) as client:
        assert client._welcome is not None and client._welcome.model == "acme/tiny"
        result = client.submit(prompt, max_new_tokens=8).result(RESULT_TIMEOUT_S)
        assert result.token_ids == expected


def _tiny_tokenizer(folder: Path, vocab_size: int) -> Path:
    """A byte-level BPE of ``vocab_size`` tokens trained on a few sentences, as a folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(PROMPTS * 20 + ["the answer is 42 and then some"] * 20, trainer)
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return folder


def test_a_preset_with_a_tokenizer_takes_text_and_structured_output(tmp_path: Path) -> None:
    """``--tokenizer`` (vLLM's) gives a random-weight preset text prompts, text and structured
    output; a tokenizer larger than the model's vocabulary stops the start-up, named."""
    from cbpipe.protocol.sampling import StructuredOutput

    folder = _tiny_tokenizer(tmp_path / "tokenizer", 300)  # the preset has 512 embeddings
    flags = ("--model", "random:qwen2-tiny", "--tokenizer", str(folder))
    with launch_engine(*flags) as run, Client(run.address) as client:
        free = client.submit("Once upon a time", max_new_tokens=4, ignore_eos=True)
        digits = client.submit(
            "The answer is",
            max_new_tokens=12,
            structured_output=StructuredOutput(regex="[0-9]{2,3}"),
        )
        assert len(free.result(timeout=RESULT_TIMEOUT_S).token_ids) == 4
        result = digits.result(timeout=RESULT_TIMEOUT_S)
        assert result.finish_reason == "stop" and result.text.isdigit(), result
        assert 2 <= len(result.text) <= 3
    too_big = ["--model", "random:qwen2-tiny", "--tokenizer", str(EMBEDDED_MODEL_DIR)]
    with pytest.raises(EngineStartError, match="has 2048 tokens, more than the model's 512"):
        EngineProcess.start(too_big)
    with pytest.raises(EngineStartError, match="is not a folder with a tokenizer.json"):
        EngineProcess.start(["--model", "random:qwen2-tiny", "--tokenizer", str(tmp_path)])

"""Text prompts and ``Result.text`` with a model that has a tokenizer: the embedded default
model, or the checkpoint folder named by ``CBPIPE_TEST_TEXT_MODEL``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from cbpipe.client import Client, RequestError
from tests.integration.conftest import EMBEDDED_MODEL_DIR, TEXT_MODEL_DIR, EngineRun
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
def text_client(text_engine: EngineRun) -> Iterator[Client]:
    with Client(text_engine.address) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TEXT_MODEL_DIR)


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

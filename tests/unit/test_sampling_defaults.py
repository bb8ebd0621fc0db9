"""The HTTP server's sampling defaults: the model's recommendations (vLLM's
``--generation-config auto``) for the fields a request leaves out, OpenAI's otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cbpipe.config import EngineConfig, ServerConfig
from cbpipe.server.common import SamplingDefaults, sampling_options
from cbpipe.server.schemas import ChatCompletionRequest, CompletionRequest

RECOMMENDED = {
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "max_new_tokens": 300,
    "do_sample": True,  # not a field: the engine samples whenever temperature > 0
    "bos_token_id": 1,
}


def folder_with(tmp_path: Path, generation_config: dict[str, object]) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return tmp_path


def test_only_the_files_own_sampling_keys_count(tmp_path: Path) -> None:
    defaults = SamplingDefaults.from_folder(folder_with(tmp_path, RECOMMENDED))
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, max_tokens=300)
    assert defaults.describe() == "temperature 0.6, top_p 0.9, top_k 20, max_tokens 300"
    # transformers' own defaults (top_k 50) are nobody's recommendation.
    bare = SamplingDefaults.from_folder(folder_with(tmp_path, {"eos_token_id": 2}))
    assert bare == SamplingDefaults() and bare.describe() == ""
    assert SamplingDefaults.from_folder(None) == SamplingDefaults()


def test_the_setting_picks_the_source(tmp_path: Path) -> None:
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir()
    other.mkdir()
    folder_with(model, RECOMMENDED)
    folder_with(other, {"temperature": 0.2})
    assert SamplingDefaults.chosen("auto", model).temperature == 0.6
    assert SamplingDefaults.chosen("none", model) == SamplingDefaults()
    assert SamplingDefaults.chosen(str(other), model) == SamplingDefaults(temperature=0.2)


def test_a_request_field_beats_the_models_default_which_beats_openais(tmp_path: Path) -> None:
    defaults = SamplingDefaults.from_folder(folder_with(tmp_path, RECOMMENDED))
    bare = CompletionRequest(prompt="x")
    options = sampling_options(bare, detokenize=True, defaults=defaults)
    assert (options["temperature"], options["top_p"], options["top_k"]) == (0.6, 0.9, 20)
    assert "min_p" not in options and "repetition_penalty" not in options
    given = CompletionRequest(prompt="x", temperature=0.0, top_p=1.0, top_k=-1)
    options = sampling_options(given, detokenize=True, defaults=defaults)
    assert (options["temperature"], options["top_p"], options["top_k"]) == (0.0, 1.0, 0)
    openai = sampling_options(ChatCompletionRequest(messages=[{"role": "user"}]), detokenize=True)
    assert openai["temperature"] == 1.0 and "top_p" not in openai and "top_k" not in openai


def test_the_flag_is_checked_before_anything_starts(tmp_path: Path) -> None:
    for good in ("auto", "none", str(folder_with(tmp_path, {}))):
        EngineConfig(server=ServerConfig(generation_config=good)).validate()
    with pytest.raises(ValueError, match="--generation-config must be"):
        EngineConfig(server=ServerConfig(generation_config=str(tmp_path / "nowhere"))).validate()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="--generation-config must be"):
        EngineConfig(server=ServerConfig(generation_config=str(tmp_path / "broken"))).validate()

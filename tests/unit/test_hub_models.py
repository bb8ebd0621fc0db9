"""Models named by their Hugging Face Hub id: found in the local cache, fetched once."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import huggingface_hub
import pytest
from huggingface_hub import constants

from cbpipe.models import EMBEDDED_MODEL_DIR, fetch_model, hub, resolve_model
from tests.hub_cache import cache_model


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache, and the Hub out of reach (a download is a test's fake)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def unreachable(*args: Any, **kwargs: Any) -> str:
        if kwargs.get("local_files_only"):
            return real_download(*args, **kwargs)
        raise AssertionError("the test reached for the Hub")

    real_download = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", _no_lookup)
    return tmp_path


def _no_lookup(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the test reached for the Hub")


def _found(*args: Any, **kwargs: Any) -> None:
    return None


@pytest.mark.parametrize(
    ("name", "is_id"),
    [("meta-llama/Llama-3.1-8B", True), ("gpt2", True), ("Qwen/Qwen2.5-0.5B-Instruct", True),
     ("./model", False), ("/abs/model", False), ("a/b/c", False), ("org/..", False),
     ("random:llama-1b", False)],
)  # fmt: skip
def test_hub_ids(name: str, is_id: bool) -> None:
    assert hub.is_hub_id(name) == is_id


def test_a_cached_model_resolves_to_its_snapshot_under_its_id(cache: Path) -> None:
    snapshot = cache_model(cache, "acme/tiny", sorted(EMBEDDED_MODEL_DIR.iterdir()))
    fetch_model("acme/tiny")  # cached: nothing to download
    source = resolve_model("acme/tiny")
    assert source.name == "acme/tiny" and source.path == snapshot
    assert source.config.to_diff_dict() | {"_name_or_path": None} == resolve_model(
        "default"
    ).config.to_diff_dict() | {"_name_or_path": None}


def test_a_revision_picks_its_own_snapshot(cache: Path) -> None:
    files = sorted(EMBEDDED_MODEL_DIR.iterdir())
    main = cache_model(cache, "acme/tiny", files)
    tagged = cache_model(cache, "acme/tiny", files, ref="v1", commit="f" * 40)
    assert resolve_model("acme/tiny").path == main
    assert resolve_model("acme/tiny", revision="v1").path == tagged
    assert resolve_model("acme/tiny", revision="f" * 40).path == tagged
    with pytest.raises(ValueError, match="at revision 'v2' is not in the Hugging Face cache"):
        resolve_model("acme/tiny", revision="v2")


def test_a_revision_of_a_local_model_is_refused(cache: Path) -> None:
    for name in ("default", "random:qwen2-tiny", str(EMBEDDED_MODEL_DIR)):
        with pytest.raises(ValueError, match="--revision applies to a Hugging Face Hub id"):
            fetch_model(name, revision="v1")


def test_an_uncached_model_is_fetched_once_with_only_what_serving_needs(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="not in the Hugging Face cache"):
        resolve_model("acme/tiny")
    asked: list[dict[str, Any]] = []

    def download(repo_id: str, **kwargs: Any) -> str:
        if kwargs.get("local_files_only"):
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        asked.append(kwargs)
        return str(cache_model(cache, repo_id, sorted(EMBEDDED_MODEL_DIR.iterdir())))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", _found)
    fetch_model("acme/tiny")
    (kwargs,) = asked
    patterns = kwargs["allow_patterns"]
    assert {"*.safetensors", "*.json"} <= set(patterns) and "*.bin" not in patterns
    assert "original/*" in kwargs["ignore_patterns"]


def test_a_model_the_hub_does_not_have_is_not_said_to_download(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A typo is looked up, not announced as a download; a model the Hub has is."""

    def missing(self: Any, repo_id: str, **kwargs: Any) -> None:
        response = SimpleNamespace(headers={}, request=None)
        raise huggingface_hub.errors.RepositoryNotFoundError(
            f"404 Client Error. Repository Not Found for url: .../{repo_id}", response=response
        )

    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", missing)
    with pytest.raises(hub.HubError, match="'defualt' could not be downloaded: 404"):
        fetch_model("defualt")
    assert "downloading" not in capsys.readouterr().err

    def download(repo_id: str, **kwargs: Any) -> str:
        if kwargs.get("local_files_only"):
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        return str(cache_model(cache, repo_id, sorted(EMBEDDED_MODEL_DIR.iterdir())))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", _found)
    fetch_model("acme/tiny")
    assert "cbpipe-launch: downloading acme/tiny into" in capsys.readouterr().err


def test_offline_and_uncached_says_so(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(hub.HubError, match="HF_HUB_OFFLINE is set") as refused:
        fetch_model("acme/missing")
    assert "nor is there a folder 'acme/missing' here" in str(refused.value)


def test_a_model_without_safetensors_weights_is_refused(cache: Path) -> None:
    cache_model(cache, "acme/old", [EMBEDDED_MODEL_DIR / "config.json"])
    with pytest.raises(hub.HubError, match="no safetensors weights"):
        fetch_model("acme/old")


def test_local_folders_and_presets_never_reach_for_the_hub(cache: Path) -> None:
    for name in ("default", "random:qwen2-tiny", str(EMBEDDED_MODEL_DIR)):
        fetch_model(name)

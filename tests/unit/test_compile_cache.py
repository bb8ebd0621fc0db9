"""The compile cache's folder: one per everything an artifact's reuse depends on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from cbpipe.models import resolve_model
from cbpipe.worker import compile_cache
from cbpipe.worker.compile_cache import CACHE_VARIABLES, cache_key, use_compile_cache

CPU = torch.device("cpu")


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for variable in CACHE_VARIABLES.values():
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


def test_the_key_changes_with_the_model_the_dtype_and_the_versions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    llama, qwen = resolve_model("random:llama-1b").config, resolve_model("random:qwen2-tiny").config
    key = cache_key(llama, torch.bfloat16, CPU)
    assert key == cache_key(llama, torch.bfloat16, CPU)  # stable: a second launch finds it
    assert key != cache_key(qwen, torch.bfloat16, CPU)
    assert key != cache_key(llama, torch.float16, CPU)
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert key != cache_key(llama, torch.bfloat16, CPU)
    monkeypatch.setattr(compile_cache, "_version", lambda package: "9.9.9")
    assert key != cache_key(llama, torch.bfloat16, CPU)


def test_both_caches_go_to_the_models_folder(
    clean_environment: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = resolve_model("random:qwen2-tiny").config
    folder = use_compile_cache(str(tmp_path), config, torch.bfloat16, CPU)
    assert folder == tmp_path / "compile" / cache_key(config, torch.bfloat16, CPU)
    for part, variable in CACHE_VARIABLES.items():
        assert Path(os.environ[variable]) == folder / part
        assert (folder / part).is_dir()


def test_the_users_own_variables_and_off_win(
    clean_environment: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = resolve_model("random:qwen2-tiny").config
    clean_environment.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    use_compile_cache(str(tmp_path), config, torch.bfloat16, CPU)
    assert os.environ["TRITON_CACHE_DIR"] == "/somewhere/else"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path))
    clean_environment.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert use_compile_cache("off", config, torch.bfloat16, CPU) is None
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_the_default_root_is_the_users_cache(
    clean_environment: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clean_environment.delenv("CBPIPE_CACHE_DIR", raising=False)
    clean_environment.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = resolve_model("random:qwen2-tiny").config
    folder = use_compile_cache(None, config, torch.bfloat16, CPU)
    assert folder is not None and folder.parent == tmp_path / "cbpipe" / "compile"
    clean_environment.setenv("CBPIPE_CACHE_DIR", str(tmp_path / "mine"))
    for variable in CACHE_VARIABLES.values():
        clean_environment.delenv(variable)
    folder = use_compile_cache(None, config, torch.bfloat16, CPU)
    assert folder is not None and folder.parent == tmp_path / "mine" / "compile"


def test_inductors_own_default_is_not_a_users_choice(
    clean_environment: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Importing inductor's configuration writes its default folder into the variable; the
    model's folder must win over that, or every model shares /tmp's."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    clean_environment.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    config = resolve_model("random:qwen2-tiny").config
    folder = use_compile_cache(str(tmp_path), config, torch.bfloat16, CPU)
    assert folder is not None
    assert Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) == folder / "inductor"

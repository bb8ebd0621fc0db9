"""A checkpoint's weights read into the engine's model in the background (``PendingWeights``):
the same tensors ``from_pretrained`` loads, through fused projections too and through staging
buffers smaller than a tensor, and a failed read raised where the worker waits, not lost in
its thread. The architecture matrix
(``tests/correctness/test_architectures.py``) serves checkpoints read this way against
``generate``; these pin down the reading itself."""

from __future__ import annotations

import functools
import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from cbpipe.models import EMBEDDED_MODEL_DIR, resolve_model
from cbpipe.worker import model_loader
from cbpipe.worker.fused_projections import FusedPart
from cbpipe.worker.model_loader import (
    PendingWeights,
    StagedCopies,
    load_model,
    start_paged_model,
)

CPU = torch.device("cpu")


def _reference() -> dict[str, torch.Tensor]:
    return dict(load_model(resolve_model("default"), CPU, torch.float32).state_dict())


@pytest.mark.parametrize(
    ("fuse", "piece_bytes"),
    [(False, model_loader.STAGING_BYTES), (True, model_loader.STAGING_BYTES), (True, 4096)],
    ids=["separate", "fused", "fused-in-pieces"],
)
def test_the_background_read_fills_what_from_pretrained_loads(
    fuse: bool, piece_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In pieces, most tensors pass through both buffers several times, each piece into its
    own rows of a fused matrix."""
    monkeypatch.setattr(
        model_loader, "StagedCopies", functools.partial(StagedCopies, piece_bytes=piece_bytes)
    )
    loading = start_paged_model(resolve_model("default"), CPU, torch.float32, fuse=fuse)
    assert loading.pending is not None, "the embedded checkpoint is read in the background"
    loading.wait_for_weights()
    model = loading.model
    reference = _reference()
    compared = fused = 0
    for name, want in reference.items():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        got = getattr(module, leaf)
        if isinstance(module, FusedPart):  # rows of the matrix the forward multiplies by
            assert (
                got.untyped_storage().data_ptr() == module.fused.weight.untyped_storage().data_ptr()
            )
            fused += 1
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
        compared += 1
    assert compared == len(reference) > 10
    assert (fused > 0) == fuse


def test_a_preset_is_built_whole_with_nothing_pending() -> None:
    loading = start_paged_model(resolve_model("random:qwen2-tiny"), CPU, torch.float32)
    assert loading.pending is None
    assert loading.wait_for_weights() == 0.0


def test_a_checkpoint_missing_a_tensor_loads_through_from_pretrained(tmp_path: Path) -> None:
    """A checkpoint that does not hold every weight under the model's own name (transformers
    converts some as it loads, or initialises what is missing) is not read by name:
    ``from_pretrained`` loads it, before the probe, with nothing left pending."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "partial"
    shutil.copytree(EMBEDDED_MODEL_DIR, folder)
    weights = load_file(folder / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    loading = start_paged_model(resolve_model(str(folder)), CPU, torch.float32)
    assert loading.pending is None


def test_a_failed_read_is_raised_by_wait() -> None:
    model = load_model(resolve_model("default"), CPU, torch.float32)
    pending = PendingWeights(model, {"lm_head.weight": Path("/nonexistent.safetensors")}, CPU)
    with pytest.raises(RuntimeError, match="reading the checkpoint's weights failed"):
        pending.wait()


def _save_checkpoint_script():  # type: ignore[no-untyped-def]
    path = Path(__file__).resolve().parents[2] / "scripts" / "save_checkpoint.py"
    spec = importlib.util.spec_from_file_location("save_checkpoint", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_saved_preset_is_read_back_as_it_was_drawn(tmp_path: Path) -> None:
    """``scripts/save_checkpoint.py`` writes a preset a start-up reads from disk (Qwen2's
    biases among its tensors), reads it back as the worker does, and drops its files from
    the page cache."""
    script = _save_checkpoint_script()
    folder = tmp_path / "qwen2-tiny"
    saved_gb = script.save("random:qwen2-tiny", folder)
    assert saved_gb > 0
    assert script.evict(folder) == 1
    for staged in (True, False):  # the benchmark's read: every tensor's bytes, less the header
        read_gb, _ = script.read(folder, "cpu", staged=staged)
        assert 0.99 * saved_gb < read_gb <= saved_gb
    loading = start_paged_model(resolve_model(str(folder)), CPU, torch.float32, fuse=False)
    assert loading.pending is not None
    loading.wait_for_weights()
    torch.manual_seed(0)
    drawn = load_model(resolve_model("random:qwen2-tiny"), CPU, torch.float32)
    got = dict(loading.model.named_parameters())
    for name, want in drawn.named_parameters():
        torch.testing.assert_close(got[name], want, rtol=0, atol=0, msg=name)


def test_staged_copies_cast_and_split_into_pieces() -> None:
    """Every element lands once whatever the pieces' edges: a tensor of many pieces and a
    part-filled last one, one that fits a piece exactly, a scalar, an empty one, a float32
    source cast to bfloat16 (the piece counted in the destination's elements), and a
    destination that is not contiguous."""
    copies = StagedCopies(pinned=False, piece_bytes=64, count=2)
    generator = torch.Generator().manual_seed(0)
    cases = [
        (torch.empty(7, 9), torch.randn(7, 9, generator=generator)),
        (torch.empty(16), torch.randn(16, generator=generator)),
        (torch.empty(()), torch.tensor(3.5)),
        (torch.empty(0, 4), torch.empty(0, 4)),
        (torch.empty(5, 13, dtype=torch.bfloat16), torch.randn(5, 13, generator=generator)),
        (torch.empty(6, 4).t(), torch.randn(4, 6, generator=generator)),
    ]
    for destination, source in cases:
        copies.copy(destination, source)
    for destination, source in cases:
        torch.testing.assert_close(destination, source.to(destination.dtype), rtol=0, atol=0)

"""A preset's random weights as a checkpoint folder, for start-ups that read weights from disk
as a user's model does (the presets build theirs on the device in about a second).

    python scripts/save_checkpoint.py save random:llama-8b DIR [--device cuda]
    python scripts/save_checkpoint.py evict DIR
    python scripts/save_checkpoint.py read DIR [--device cuda] [--unstaged] [--evict]
                                               [--host-threads N]

``save`` writes what ``save_pretrained`` writes (the configuration and safetensors files) and
the embedded model's tokenizer beside them, which the scheduler needs for a folder (its 2,048
tokens fit any preset's vocabulary but ``qwen2-tiny``'s). ``evict`` drops the folder's
weight files from the page cache (``posix_fadvise``, no privileges needed), so that the next
launch reads them from disk, as the first one after a download does. ``read`` times the
worker's read of the weights alone, onto ``--device`` through its pinned staging buffers
(``model_loader.StagedCopies``), or with ``--unstaged`` as straight pageable copies, the read
of session 50; ``--host-threads`` sets torch's intra-op threads, which the staging's host
copies run on (the worker leaves them at torch's default). On an H100 host an 8B
checkpoint's 16.1 GB saved in 29-33 s and loaded in 12.9 s evicted, 4.0 s from the page cache
(docs/PERFORMANCE.md, session 50).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cbpipe.models import EMBEDDED_MODEL_DIR, RANDOM_PREFIX, resolve_model  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def save(preset: str, folder: Path, device: str = "cpu", seed: int = 0) -> float:
    """``preset``'s random weights (built on ``device``) saved into ``folder``, with the
    embedded model's tokenizer; the gigabytes written."""
    from transformers import AutoModelForCausalLM

    if not preset.startswith(RANDOM_PREFIX):
        raise ValueError(f"{preset!r} is not a preset ({RANDOM_PREFIX}NAME)")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            resolve_model(preset).config, dtype=torch.bfloat16 if device == "cuda" else None
        )
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(EMBEDDED_MODEL_DIR / name, folder / name)
    os.sync()  # written back, so that evict can drop the pages
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9


def evict(folder: Path) -> int:
    """Drop ``folder``'s weight files from the page cache; how many files."""
    files = sorted(folder.glob("*.safetensors"))
    for file in files:
        descriptor = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)
    return len(files)


def read(folder: Path, device: str = "cuda", staged: bool = True) -> tuple[float, float]:
    """Every tensor of ``folder``'s weight files copied onto ``device`` as the worker reads a
    checkpoint, on a stream of its own; the gigabytes read and the seconds it took."""
    from safetensors import safe_open

    from cbpipe.worker.model_loader import StagedCopies, read_tensors

    files = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt", device="cpu") as handle:
            files.update(dict.fromkeys(handle.keys(), file))
    cuda = torch.device(device).type == "cuda"
    stream = torch.cuda.Stream(device) if cuda else None
    copies = StagedCopies(pinned=cuda)
    kept: list[torch.Tensor] = []  # the weights stay, as in a model

    def copy(name: str, source: torch.Tensor) -> None:
        kept.append(torch.empty_like(source, device=device))
        if staged:
            copies.copy(kept[-1], source)
        else:
            kept[-1].copy_(source, non_blocking=cuda)

    started = time.perf_counter()
    with contextlib.ExitStack() as stack, torch.no_grad():
        if stream is not None:
            stack.enter_context(torch.cuda.stream(stream))
        read_tensors(files, copy)
        if stream is not None:
            stream.synchronize()
    return sum(t.numel() * t.element_size() for t in kept) / 1e9, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    saving = commands.add_parser("save", help="write PRESET's random weights into FOLDER")
    saving.add_argument("preset")
    saving.add_argument("folder", type=Path)
    saving.add_argument("--device", default="cpu", help="where to draw the weights")
    evicting = commands.add_parser("evict", help="drop FOLDER's weights from the page cache")
    evicting.add_argument("folder", type=Path)
    reading = commands.add_parser("read", help="time the worker's read of FOLDER's weights")
    reading.add_argument("folder", type=Path)
    reading.add_argument("--device", default="cuda")
    reading.add_argument("--unstaged", action="store_true", help="pageable copies, unstaged")
    reading.add_argument("--evict", action="store_true", help="evict the files first")
    reading.add_argument("--host-threads", type=int, help="torch's intra-op threads")
    args = parser.parse_args(argv)
    if args.command == "read" and args.host_threads:
        torch.set_num_threads(args.host_threads)
    if args.command == "read" and args.evict:
        evict(args.folder)
    started = time.perf_counter()
    if args.command == "save":
        size = save(args.preset, args.folder, args.device)
        print(f"saved {args.preset} ({size:.1f} GB) into {args.folder} in "
              f"{time.perf_counter() - started:.1f} s")  # fmt: skip
    elif args.command == "read":
        size, took = read(args.folder, args.device, staged=not args.unstaged)
        how = "unstaged" if args.unstaged else "staged"
        print(f"read {size:.2f} GB of {args.folder} onto {args.device} "
              f"({how}, {torch.get_num_threads()} host threads"
              f"{', files evicted first' if args.evict else ''}) in {took:.1f} s, "
              f"{size / took:.2f} GB/s")  # fmt: skip
    else:
        print(f"evicted {evict(args.folder)} files of {args.folder} from the page cache")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The architecture matrix on a device: every served architecture against ``generate``.

    python scripts/check_architectures.py --device cuda --dtypes bfloat16,float32

For each architecture of ``tests/architectures.py`` (tiny random-weight checkpoints written
with ``save_pretrained``, sliding windows of 12 tokens, blocks of 8, chunks of 24), the
engine's own step runner (``tests/harness.py``: scheduler core, packer, worker runner, with
the worker's defaults on CUDA: the Triton kernels and decode CUDA graphs) serves a set of
prompts that cross the window, and transformers' ``generate`` on the same device and dtype
gives the reference. It prints, per architecture and dtype, how many prompts match exactly,
where the others first differ and the reference's logit gap there (two top logits within
rounding of each other make a tie, not a bug); then the totals. Architectures the installed
transformers lacks are listed as skipped; the refused ones are checked to be refused.

Exact equality is the contract in float32 on the CPU (``tests/correctness``). On a GPU in
bfloat16 the engine and transformers multiply different shapes (packed steps, split-KV
attention against SDPA), which round differently, so a random model's near-ties may flip.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cbpipe.models import resolve_model  # noqa: E402
from cbpipe.models.support import UnsupportedModel  # noqa: E402
from cbpipe.protocol.sampling import SamplingParams  # noqa: E402
from cbpipe.worker.model_loader import load_paged_model  # noqa: E402
from tests.architectures import REFUSED, SERVED, WINDOW, Arch, build_checkpoint  # noqa: E402
from tests.harness import InProcessEngine, reference_model  # noqa: E402

VOCAB = 256
PROMPT_LENS = (1, 5, WINDOW - 1, WINDOW, WINDOW + 1, 17, 30, 40, 64, 100)
MAX_NEW_TOKENS = 16


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]


@torch.inference_mode()
def reference(model: torch.nn.Module, prompt: list[int], device: torch.device) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=MAX_NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def logit_gap(model: torch.nn.Module, ids: list[int], a: int, b: int, device) -> float:  # type: ignore[no-untyped-def]
    logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -1].float()
    return abs(float(logits[a] - logits[b]))


def check(arch: Arch, folder: Path, device: torch.device, dtype: torch.dtype) -> dict:
    started = time.perf_counter()
    name = str(folder)
    engine = InProcessEngine(
        name,
        num_blocks=256,
        block_size=8,
        max_num_seqs=4,
        max_batch_tokens=24,
        max_model_len=256,
        device=device,
        dtype=dtype,
    )
    params = [SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True) for _ in prompts()]
    try:
        got = engine.generate(prompts(), params, mode="random", rng=random.Random(3))
    finally:
        engine.close()
    model = reference_model(name, device, dtype)
    divergences = []
    equal = 0
    for prompt, output in zip(prompts(), got, strict=True):
        want = reference(model, prompt, device)
        pairs = enumerate(zip(output, want, strict=False))
        at = next((i for i, (g, w) in pairs if g != w), None)
        if at is None and len(output) != len(want):
            at = min(len(output), len(want))
        if at is None:
            equal += 1
            continue
        gap = float("nan")
        if at < min(len(output), len(want)):
            gap = logit_gap(model, prompt + want[:at], want[at], output[at], device)
        divergences.append({"prompt_len": len(prompt), "token": at, "gap": round(gap, 5)})
    graphs = len(engine.runner.graphs)
    return {
        "arch": arch.name,
        "dtype": str(dtype).removeprefix("torch."),
        "features": list(arch.features),
        "equal": equal,
        "prompts": len(got),
        "divergences": divergences,
        "decode_graphs": graphs,
        "seconds": round(time.perf_counter() - started, 1),
    }


def check_refused(arch: Arch, folder: Path, device: torch.device) -> dict:
    try:
        load_paged_model(resolve_model(str(folder)), device, torch.float32)
    except UnsupportedModel as exc:
        return {"arch": arch.name, "refused": True, "message": str(exc)}
    return {"arch": arch.name, "refused": False, "message": "served: expected a refusal"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--archs", default="", help="comma list (default: all)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",") if d]
    wanted = set(filter(None, args.archs.split(",")))
    root = Path(tempfile.mkdtemp(prefix="cbpipe-archs-"))
    rows, refused, skipped = [], [], []
    for arch in [*SERVED, *REFUSED]:
        if wanted and arch.name not in wanted:
            continue
        try:
            folder = build_checkpoint(arch, root / arch.name)
        except Exception as exc:  # not in this transformers version, or a config it rejects
            skipped.append({"arch": arch.name, "why": f"{type(exc).__name__}: {exc}"[:200]})
            print(f"{arch.name:14} skipped: {skipped[-1]['why']}", flush=True)
            continue
        if arch in REFUSED:
            refused.append(check_refused(arch, folder, device))
            print(f"{arch.name:14} refused={refused[-1]['refused']}: {refused[-1]['message']}")
            continue
        for dtype in dtypes:
            try:
                row = check(arch, folder, device, dtype)
            except UnsupportedModel as exc:
                # Served on the CPU's transformers, refused with its reason on this one (GPT-J
                # and CodeGen compute attention themselves in 5.17): a refusal, not a wrong
                # answer, so it is reported apart and does not fail the run.
                row = {"arch": arch.name, "dtype": str(dtype).removeprefix("torch."),
                       "refused_here": str(exc)}  # fmt: skip
                print(f"{arch.name:14} {dtype}: refused by this transformers: {exc}", flush=True)
                rows.append(row)
                continue
            except Exception:
                row = {
                    "arch": arch.name,
                    "dtype": str(dtype).removeprefix("torch."),
                    "error": traceback.format_exc(),
                }
                print(f"{arch.name:14} {dtype}: ERROR\n{row['error']}", flush=True)
                rows.append(row)
                continue
            rows.append(row)
            parts = ", ".join(
                f"len {d['prompt_len']} at token {d['token']} (gap {d['gap']:.3g})"
                for d in row["divergences"]
            )
            print(
                f"{arch.name:14} {row['dtype']:9} {row['equal']:2}/{row['prompts']} equal"
                f"{'; differ: ' + parts if parts else ''}  [{row['seconds']} s, "
                f"{row['decode_graphs']} graphs]",
                flush=True,
            )
    print()
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        mine = [r for r in rows if r.get("dtype") == name]
        done = [r for r in mine if "equal" in r]
        exact = [r for r in done if r["equal"] == r["prompts"]]
        errors = [r for r in mine if "error" in r]
        refused_here = [r["arch"] for r in mine if "refused_here" in r]
        print(
            f"{name}: {len(exact)}/{len(done) + len(errors)} architectures match exactly on "
            f"every prompt; {sum(r['equal'] for r in done)}/{sum(r['prompts'] for r in done)} "
            f"prompts equal; errors: {[r['arch'] for r in errors]}; refused by this "
            f"transformers ({transformers.__version__}): {refused_here}"
        )
    print(f"refused as expected: {sum(r['refused'] for r in refused)}/{len(refused)}; "
          f"skipped: {[s['arch'] for s in skipped]}")  # fmt: skip
    if args.json:
        report = {"device": str(device), "rows": rows, "refused": refused, "skipped": skipped}
        args.json.write_text(json.dumps(report, indent=1))
    failed = any("error" in r for r in rows) or not all(r["refused"] for r in refused)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

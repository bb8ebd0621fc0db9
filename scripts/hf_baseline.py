"""The benchmark's workload through transformers itself: ``generate_batch`` and ``generate``.

Same weights as the engine (a random preset is rebuilt from the same seed on the same device,
a checkpoint is loaded from the same folder), same prompts, greedy, every request forced to
its full output length with ``min_new_tokens``. ``generate_batch`` is transformers' own
continuous batching; ``generate`` runs all requests as one padded batch. Used by
``scripts/bench.py --compare-transformers``; fixed output lengths only, since both take one
``max_new_tokens`` for the whole batch. ``generate_batch``'s time includes what each call
sets up (sizing its cache, its own warm-up); the engine's start-up is not in cbpipe's time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel

from cbpipe.models import resolve_model
from cbpipe.worker.model_loader import load_model, resolve_device, resolve_dtype


@dataclass
class BaselineResult:
    method: str
    wall_s: float
    output_tokens: int
    output_tok_s: float
    same_as_cbpipe: int | None  # requests whose tokens equal the engine's (None: not compared)
    error: str | None = None


def run_transformers(
    model_name: str,
    device_name: str,
    dtype_name: str,
    prompts: list[list[int]],
    output_len: int,
    engine_outputs: list[list[int]] | None,
) -> list[BaselineResult]:
    device = resolve_device(device_name)
    model = load_model(resolve_model(model_name), device, resolve_dtype(dtype_name, device), seed=0)
    config = GenerationConfig(
        max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0
    )
    results = []
    for method, run in (("generate_batch", _generate_batch), ("generate", _generate)):
        try:
            _sync(device)
            start = time.perf_counter()
            outputs = run(model, prompts, config, device)
            _sync(device)
            wall = time.perf_counter() - start
        except Exception as exc:  # the comparison is optional: report, do not abort the run
            results.append(
                BaselineResult(method, 0.0, 0, 0.0, None, f"{type(exc).__name__}: {exc}")
            )
            continue
        num_tokens = sum(len(o) for o in outputs)
        same = None
        if engine_outputs is not None:
            same = sum(a == b for a, b in zip(outputs, engine_outputs, strict=True))
        results.append(BaselineResult(method, wall, num_tokens, num_tokens / wall, same))
    return results


def _generate_batch(
    model: PreTrainedModel,
    prompts: list[list[int]],
    config: GenerationConfig,
    device: torch.device,
) -> list[list[int]]:
    outputs = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    # Request ids are "req_<index>" in submission order; order by index, not by string.
    ordered = sorted(outputs.values(), key=lambda o: int(str(o.request_id).rsplit("_", 1)[-1]))
    return [list(o.generated_tokens) for o in ordered]


def _generate(
    model: PreTrainedModel,
    prompts: list[list[int]],
    config: GenerationConfig,
    device: torch.device,
) -> list[list[int]]:
    longest = max(len(p) for p in prompts)
    # Left padding, so every row's last prompt token is the last column.
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    out = model.generate(ids.to(device), attention_mask=mask.to(device), generation_config=config)
    return [row[longest:].tolist() for row in out]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

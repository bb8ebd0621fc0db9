"""Where a model comes from: the embedded checkpoint, a local folder, a Hugging Face Hub id
(``hub.py``), or a random-weight preset.

Resolving a name reads configuration only (no weights), so the launcher can size the engine
and the scheduler can find the tokenizer without loading the model. Building the weights is
the worker's business.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, Gemma2Config, LlamaConfig, PretrainedConfig, Qwen2Config

from cbpipe.models import hub

EMBEDDED_MODEL_DIR = Path(__file__).parent / "default"
RANDOM_PREFIX = "random:"


def _llama3(hidden: int, layers: int, heads: int, intermediate: int, tie: bool) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=hidden // heads,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=128000,
        eos_token_id=128001,
    )


def _preset_configs() -> dict[str, PretrainedConfig]:
    return {
        # Shapes of Llama 3.2 1B and Llama 3.1 8B.
        "llama-1b": _llama3(hidden=2048, layers=16, heads=32, intermediate=8192, tie=True),
        "llama-8b": _llama3(hidden=4096, layers=32, heads=32, intermediate=14336, tie=False),
        # Llama 3.1 70B's shape: 141 GB of bfloat16 weights, more than one H200 holds, for
        # --tensor-parallel-size 2 and up (each rank materialises only its shard).
        "llama-70b": _llama3(hidden=8192, layers=80, heads=64, intermediate=28672, tie=False),
        # Gemma 2 2B's shape: sliding windows of 4096 on every other layer, soft-capped
        # attention and logits, head_dim 256, query_pre_attn_scalar 256, tied embeddings.
        "gemma2-2b": Gemma2Config(
            vocab_size=256000,
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=0,
        ),
        # A second architecture for correctness tests: attention biases, GQA 4:1.
        "qwen2-tiny": Qwen2Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    }


PRESET_NAMES = tuple(_preset_configs())


@dataclass(frozen=True)
class ModelSource:
    """A resolved model name; ``path`` is None for random-weight presets."""

    name: str
    path: Path | None
    config: PretrainedConfig
    tokenizer: Path | None = None  # --tokenizer: used instead of the model's own

    @property
    def tokenizer_path(self) -> Path | None:
        return self.tokenizer or self.path

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.config.eos_token_id
        if self.path is not None and (self.path / "generation_config.json").exists():
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(self.path).eos_token_id
        if eos is None:
            return []
        return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def resolve_model(
    name: str, revision: str | None = None, tokenizer: str | None = None
) -> ModelSource:
    """Resolve a ``--model`` value (at ``--revision``, for a Hub id) and its ``--tokenizer``;
    raises ``ValueError`` saying what would have worked."""
    source = _resolve_model(name, revision)
    if tokenizer is None:
        return source
    folder = Path(tokenizer).expanduser()
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(
            f"--tokenizer {tokenizer!r} is not a folder with a tokenizer.json or "
            "tokenizer_config.json"
        )
    return dataclasses.replace(source, tokenizer=folder.resolve())


def _resolve_model(name: str, revision: str | None) -> ModelSource:
    if name == "default":
        return ModelSource(name, EMBEDDED_MODEL_DIR, AutoConfig.from_pretrained(EMBEDDED_MODEL_DIR))
    if name.startswith(RANDOM_PREFIX):
        preset = name.removeprefix(RANDOM_PREFIX)
        configs = _preset_configs()
        if preset not in configs:
            raise ValueError(
                f"unknown preset {name!r}; presets: "
                + ", ".join(RANDOM_PREFIX + p for p in PRESET_NAMES)
            )
        return ModelSource(name, None, configs[preset])
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return ModelSource(name, path.resolve(), AutoConfig.from_pretrained(path))
    if hub.is_hub_id(name) and not path.exists():
        # Fetched by the launcher (hub.fetch) before any process resolves it.
        snapshot = hub.cached_snapshot(name, revision)
        if snapshot is None:
            at = f" at revision {revision!r}" if revision else ""
            raise ValueError(
                f"model {name!r}{at} is not in the Hugging Face cache: cbpipe-launch "
                "downloads it first (hub.fetch)"
            )
        return ModelSource(name, snapshot, AutoConfig.from_pretrained(snapshot))
    raise ValueError(
        f"model {name!r} is neither 'default', a preset ("
        + ", ".join(RANDOM_PREFIX + p for p in PRESET_NAMES)
        + "), a folder with a config.json nor a Hugging Face Hub id"
    )


def fetch_model(name: str, revision: str | None = None) -> None:
    """Download ``name`` (at ``revision``) into the Hugging Face cache if it is a Hub id that
    is not there; the launcher's first step. Raises ``ValueError`` (``hub.HubError``) saying
    why it cannot."""
    path = Path(name).expanduser()
    local = name == "default" or name.startswith(RANDOM_PREFIX) or path.exists()
    if revision is not None and (local or not hub.is_hub_id(name)):
        raise ValueError(f"--revision applies to a Hugging Face Hub id, not to {name!r}")
    if local:
        return
    if hub.is_hub_id(name):
        try:
            hub.fetch(name, revision)
        except hub.HubError as exc:
            raise hub.HubError(f"{exc}; nor is there a folder {str(path)!r} here") from None

"""Per-request sampling parameters: one definition, validated on both sides of the socket."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens and when it stops.

    ``temperature == 0`` is greedy decoding. A request with a ``seed`` draws the same tokens
    whatever else shares its batch: the random number for output token ``i`` depends only on
    ``(seed, i)``.
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first parameter that is out of range."""
        _check_int("max_new_tokens", self.max_new_tokens, low=1)
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, low=0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=MAX_SEED)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError("stop_token_ids must be a list of token ids")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids entry", token_id, low=0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _check_int(name: str, value: object, *, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")

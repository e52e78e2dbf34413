"""SamplingParams: validated when built, so a bad value fails before any work starts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 is greedy decoding (argmax, no sort). top_k 0 and top_p 1.0 disable those filters.
    A seed makes sampling repeat exactly; without one each request draws fresh randomness.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # When the context is full: drop the older half of what follows the first `context_keep` tokens
    # (re-rotating the keys that move) and go on, instead of stopping with finish_reason "length".
    context_shift: bool = False
    context_keep: int = 4

    def __post_init__(self) -> None:
        _check(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
               f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")  # fmt: skip
        _check(self.temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        _check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer or None, got {self.seed!r}")
        _check(self.context_keep >= 0, f"context_keep must be >= 0, got {self.context_keep!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)

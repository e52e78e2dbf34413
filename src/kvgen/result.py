"""What a finished request returns, the same type from `LLM.generate`, `generate_batch`, the engine
and the server: text, token ids, why it finished, usage, timings and logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvgen.sampling.sampler import TokenLogprob

if TYPE_CHECKING:
    from kvgen.speculative.adaptive import SpeculativeStats


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused instead of recomputed

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Timings:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0  # tokens produced by decode steps (the first token comes from prefill)
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


@dataclass
class GenerationResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # "stop" (EOS, stop token, stop string, grammar complete) or "length"; the engine adds
    # "cancelled" and "error" for requests it ended.
    finish_reason: str | None = None
    # What stopped it: the stop string or stop token id that matched; None for EOS, grammar or length.
    stop_reason: str | int | None = None
    error: str | None = None  # what went wrong, when finish_reason is "error"
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    logprobs: list[TokenLogprob] | None = None  # one per generated token when params.logprobs
    speculative: "SpeculativeStats | None" = None  # draft/accept counts when speculative decoding ran

"""Turns the last position's logits into a token id under SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kvgen.kernels import load
from kvgen.sampling.grammar import TokenConstraint
from kvgen.sampling.params import SamplingParams
from kvgen.sampling.processors import (
    GrammarProcessor,
    LogitBiasProcessor,
    LogitsProcessor,
    MinTokensProcessor,
    PenaltyProcessor,
)


def argmax(scores: torch.Tensor) -> int:
    """torch.argmax of scores [V] (the first maximum; the first NaN if any), in C for fp32 on the
    CPU: torch's scalar pass over Gemma 3's 262,144 logits took 2% of a decode step."""
    library = load()
    if library is None or scores.dtype != torch.float32 or scores.device.type != "cpu" or scores.dim() != 1:
        return int(torch.argmax(scores))
    scores = scores.contiguous()
    return int(library.kvgen_argmax_f32(scores.data_ptr(), scores.numel()))


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the raw model, and the most likely alternatives
    (id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class Sampler:
    """One per request (or per sample): it owns the random stream, so a seed reproduces the same text,
    and the state of the processors (token counts, grammar)."""

    def __init__(
        self,
        params: SamplingParams,
        *,
        prompt_ids: Sequence[int] = (),
        vocab_size: int | None = None,
        stop_ids: Sequence[int] = (),
        constraint: TokenConstraint | None = None,
        seed_offset: int = 0,
    ):
        self.params = params
        self.constraint = constraint
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed + seed_offset)  # sample i of n uses seed + i
        else:
            self.generator.seed()
        self.processors = self._build_processors(prompt_ids, vocab_size, stop_ids)
        self.logprobs: list[TokenLogprob] = []

    def _build_processors(self, prompt_ids: Sequence[int], vocab_size: int | None, stop_ids: Sequence[int]) -> list[LogitsProcessor]:
        p = self.params
        processors: list[LogitsProcessor] = []
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            if vocab_size is None:
                raise ValueError("penalties need the vocabulary size: pass vocab_size to the Sampler")
            processors.append(PenaltyProcessor(p.repetition_penalty, p.presence_penalty, p.frequency_penalty, prompt_ids, vocab_size))
        if p.logit_bias:
            processors.append(LogitBiasProcessor(dict(p.logit_bias)))
        if p.min_new_tokens:
            processors.append(MinTokensProcessor(p.min_new_tokens, stop_ids))
        if self.constraint is not None:
            processors.append(GrammarProcessor(self.constraint))
        return processors

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to process or record: the argmax of the raw logits is the choice."""
        return self.params.greedy and not self.processors and not self.params.logprobs and not self.params.top_logprobs

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] (may be modified) -> token id; records the logprob when asked to."""
        return self.choose(logits, self.pick)

    def choose(self, logits: torch.Tensor, pick: Callable[[torch.Tensor], int]) -> int:
        """Run the processors over logits [V] (may be modified), let `pick` choose from the processed
        scores, then advance the processors past the choice and record its logprob. Speculative
        verification passes its own `pick` (accept a draft or resample) and gets the same penalties,
        grammar and logprobs as plain sampling. A GPU model's logits are read here, on the CPU,
        where the processors, grammar masks and the seeded random stream live."""
        if logits.device.type != "cpu":
            logits = logits.to("cpu", torch.float32)
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if self.params.logprobs else None
        for processor in self.processors:
            logits = processor(logits)
        token = pick(logits)
        for processor in self.processors:
            processor.observe(token)
        if raw_logprobs is not None:
            self.logprobs.append(self._logprob(raw_logprobs, token))
        return token

    def pick(self, scores: torch.Tensor) -> int:
        """A token from processed scores [V]: argmax when greedy (no sort, no softmax), else a sample."""
        if self.params.greedy:
            return argmax(scores)
        return int(torch.multinomial(self.probabilities(scores), 1, generator=self.generator))

    def _logprob(self, logprobs: torch.Tensor, token: int) -> TokenLogprob:
        top: list[tuple[int, float]] = []
        if self.params.top_logprobs:
            values, ids = torch.topk(logprobs, self.params.top_logprobs)
            top = list(zip(ids.tolist(), values.tolist()))
        return TokenLogprob(token, float(logprobs[token]), top)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution sampling draws from: temperature, then min-p, top-k, top-p (vLLM's order); [V]."""
        p = self.params
        scores = logits.float() / p.temperature
        if p.min_p > 0:
            # Drop tokens less likely than min_p times the most likely one.
            probs = torch.softmax(scores, dim=-1)
            scores = scores.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_k and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            sorted_probs = torch.softmax(sorted_scores, dim=-1)
            # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            scores = scores.scatter(0, order[drop], float("-inf"))
        return torch.softmax(scores, dim=-1)

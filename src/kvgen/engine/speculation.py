"""Speculative decoding inside the engine, per request (opt-in with `speculative=`).

Before each step a decoding request drafts k tokens with its own proposer; the scheduler gives its
row 1 + k tokens (the last sampled token, then the drafts), so the drafts are verified in the same
batched forward as every other request's decode or prefill chunk. The row's k + 1 logits go through
`verify` with the request's sampler (grammar, penalties, logprobs), and the cache is cut back to the
accepted tokens, which returns the blocks the rejected drafts used to the pool.

The EAGLE head is not offered here: it drafts from the target's hidden states, which the batched
forward does not return; lookup, self-draft and a draft model are.
"""

from __future__ import annotations

import torch

from kvgen.sampling.sampler import Sampler
from kvgen.speculative.adaptive import SpeculativeStats
from kvgen.speculative.config import SpeculativeConfig
from kvgen.speculative.proposer import Draft, DraftPolicy, Proposer
from kvgen.speculative.verify import verify

ENGINE_METHODS = ("lookup", "self", "draft")


def check_engine_method(config: SpeculativeConfig) -> None:
    if config.method not in ENGINE_METHODS:
        raise ValueError(f"speculative method {config.method!r} is not available in the engine (its head reads the "
                         f"target's hidden states): use one of {', '.join(ENGINE_METHODS)}")  # fmt: skip


class RequestSpeculation:
    """One request's proposer, draft-length controller and counts, and the draft of the coming step."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, sampler: Sampler, totals: SpeculativeStats):
        self.proposer, self.sampler = proposer, sampler
        self.totals = totals  # the engine's counts over every request (a metric)
        self.policy = DraftPolicy(sampler.params)
        self.controller = config.new_controller()
        self.stats = SpeculativeStats()
        self.draft: list[int] = []
        self._draft_probs: torch.Tensor | None = None

    def propose(self, ids: list[int], max_tokens: int) -> None:
        """Draft up to `max_tokens` tokens to follow `ids` (every committed id; the last not yet computed)."""
        k = min(self.controller.draft_length(), max_tokens)
        draft = self.proposer.propose(ids, k, self.policy, self.sampler.constraint) if k > 0 else Draft([])
        self.draft, self._draft_probs = draft.tokens, draft.probs

    def trim(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` drafts (the step's token budget ran short)."""
        self.draft = self.draft[:num_tokens]
        if self._draft_probs is not None:
            self._draft_probs = self._draft_probs[:num_tokens] if num_tokens else None

    def discard(self) -> None:
        self.draft, self._draft_probs = [], None

    def verify(self, logits: torch.Tensor) -> list[int]:
        """logits [1 + len(draft), V] of the row's positions -> the accepted drafts and one target token."""
        draft = Draft(self.draft, self._draft_probs)
        self.discard()
        if not draft.tokens:
            self.stats.plain_steps += 1
            return [self.sampler(logits[-1])]
        tokens = verify(logits, draft, self.sampler)
        accepted = len(tokens) - 1
        self.controller.record(len(draft.tokens), accepted)
        self.stats.record_verify(len(draft.tokens), accepted)
        self.totals.record_verify(len(draft.tokens), accepted)
        return tokens

    def release(self) -> None:
        self.proposer.release()

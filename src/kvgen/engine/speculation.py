"""Speculative decoding inside the engine, per request (opt-in with `speculative=`).

Before each step a decoding request drafts k tokens with its own proposer; the scheduler gives its
row 1 + k tokens (the last sampled token, then the drafts), so the drafts are verified in the same
batched forward as every other request's decode or prefill chunk. The row's k + 1 logits go through
`verify` with the request's sampler (grammar, penalties, logprobs), and the cache is cut back to the
accepted tokens, which returns the blocks the rejected drafts used to the pool.

The EAGLE head drafts from the target's last-layer features: the batched forward then returns them
too (`forward_batch(..., with_hidden=True)`), and each decoding row hands its proposer the features
of the tokens it committed (a decode's one, a verify's last id and accepted drafts), as the
single-sequence decoder does; the prompt's are never needed, so a request's first step drafts
nothing. The engine verifies chains: the runner-up first tokens the decoder verifies as a tree
(`draft_alternatives`) are refused here.
"""

from __future__ import annotations

import torch

from kvgen.sampling.sampler import Sampler
from kvgen.speculative.adaptive import SpeculativeStats
from kvgen.speculative.config import SpeculativeConfig
from kvgen.speculative.proposer import Draft, DraftPolicy, Proposer
from kvgen.speculative.verify import verify

def check_engine_config(config: SpeculativeConfig) -> None:
    if config.draft_alternatives:
        raise ValueError("draft_alternatives are verified as a token tree by the single-sequence decoder; the engine "
                         "verifies chains: leave draft_alternatives unset or at 0")  # fmt: skip


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

    @property
    def needs_features(self) -> bool:
        """Whether the rows of this request must come with the target's features (EAGLE)."""
        return self.proposer.needs_target_features

    def propose(self, ids: list[int], max_tokens: int) -> None:
        """Draft up to `max_tokens` tokens to follow `ids` (every committed id; the last not yet computed)."""
        k = min(self.controller.draft_length(), max_tokens)
        if self.needs_features and not self._has_features:
            k = 0  # the first decode gives the proposer the features it starts from
        draft = self.proposer.propose(ids, k, self.policy, self.sampler.constraint) if k > 0 else Draft([])
        self.draft, self._draft_probs = draft.tokens, draft.probs

    def trim(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` drafts (the step's token budget ran short)."""
        self.draft = self.draft[:num_tokens]
        if self._draft_probs is not None:
            self._draft_probs = self._draft_probs[:num_tokens] if num_tokens else None

    def discard(self) -> None:
        self.draft, self._draft_probs = [], None

    _has_features = False

    def verify(self, logits: torch.Tensor, features: torch.Tensor | None = None) -> list[int]:
        """logits [1 + len(draft), V] of the row's positions -> the accepted drafts and one target
        token. features: the target's features at those positions, where the proposer reads them
        and the row's last id is a generated token (None: a prompt's last token)."""
        draft = Draft(self.draft, self._draft_probs)
        self.discard()
        if not draft.tokens:
            self.stats.plain_steps += 1
            self._observe(features)
            self._step = (0, 0)
            return [self.sampler(logits[-1])]
        tokens = verify(logits, draft, self.sampler)
        accepted = len(tokens) - 1
        self._observe(None if features is None else features[: accepted + 1])
        self._step = (len(draft.tokens), accepted)
        self.stats.record_verify(len(draft.tokens), accepted)
        self.totals.record_verify(len(draft.tokens), accepted)
        return tokens

    _step: tuple[int, int] | None = None  # (drafted, accepted) of the step verified last, until settled

    def settle(self, seconds: float | None) -> None:
        """Tell the draft-length controller about the step just verified. seconds: the step's time
        where it was this request's alone (its draft and a forward of its row only), as the
        single-sequence decoder times its steps; None in a batch, where the rates alone decide."""
        step, self._step = self._step, None
        if step is None:
            return
        drafted, accepted = step
        if not drafted:
            if seconds is not None:
                self.controller.record_plain(seconds)
            return
        self.controller.record(drafted, accepted, seconds=seconds)

    def _observe(self, features: torch.Tensor | None) -> None:
        if self.needs_features and features is not None:
            self.proposer.observe_features(features)
            self._has_features = True

    def release(self) -> None:
        self.proposer.release()

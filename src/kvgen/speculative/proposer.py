"""The proposer interface: something that guesses the next few tokens cheaply.

A proposer sees the whole committed sequence (prompt + generated, the last id not yet in the target's
cache) and returns a `Draft`. Drafting must leave no trace the target can see: a proposer keeps its own
state (a draft cache, an n-gram index) and re-synchronises it with the ids it is given on every call, so
rejected drafts need no explicit rollback message. A proposer given the target's cache (`attach`) may
write positions past the committed ones while it drafts, and must truncate them away before it returns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvgen.kv.interface import KVCache
from kvgen.sampling.grammar import TokenConstraint
from kvgen.sampling.params import SamplingParams
from kvgen.sampling.sampler import Sampler, argmax
from kvgen.token_ids import common_prefix_length


@dataclass
class Draft:
    tokens: list[int]
    # [len(tokens), V]: the distribution each token was drawn from (q in rejection sampling).
    # None: the tokens were chosen deterministically (q is one-hot), as greedy drafts and lookups are.
    probs: torch.Tensor | None = None
    # Runner-up guesses for tokens[0], verified beside the chain as leaves of a token tree (greedy
    # drafts only: DraftPolicy.alternatives).
    alternatives: list[int] = field(default_factory=list)


def mask_logits(logits: torch.Tensor, constraint: TokenConstraint | None) -> torch.Tensor:
    """Disallowed tokens get -inf, so neither argmax nor sampling can pick them."""
    if constraint is None:
        return logits
    return logits.masked_fill(~constraint.allowed_mask(logits.shape[-1]), float("-inf"))


def can_extend(constraint: TokenConstraint | None) -> bool:
    """Whether a draft may go on: a finished grammar allows nothing more."""
    return constraint is None or not constraint.is_finished()


class DraftedPath:
    """Advances a constraint along the tokens a proposer drafts and rewinds it afterwards, so the
    proposer leaves the constraint as it found it (use as a context manager)."""

    def __init__(self, constraint: TokenConstraint | None):
        self.constraint, self.advanced = constraint, 0

    def __enter__(self) -> "DraftedPath":
        return self

    def allows(self, token: int) -> bool:
        c = self.constraint
        return c is None or (not c.is_finished() and bool(c.allowed_mask(token + 1)[token]))

    def advance(self, token: int) -> bool:
        """Move past an allowed drafted token; False when nothing more may be drafted after it."""
        if self.constraint is None:
            return True
        if not self.constraint.advance(token):
            raise RuntimeError(f"the grammar rejected drafted token {token} it had allowed")
        self.advanced += 1
        return not self.constraint.is_finished()

    def __exit__(self, *exc: object) -> None:
        if self.constraint is not None and self.advanced:
            self.constraint.rollback(self.advanced)


class DraftPolicy:
    """How a drafting model picks its tokens: argmax when the request is greedy, else a sample from
    the request's processed distribution, drawn with the draft's own random stream."""

    def __init__(self, params: SamplingParams, alternatives: int = 0):
        seed = None if params.seed is None else params.seed + 1  # independent of the target's stream
        self.sampler = Sampler(SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                              top_p=params.top_p, seed=seed))  # fmt: skip
        self.greedy = params.greedy
        assert alternatives == 0 or self.greedy, "alternatives are verified for greedy drafts only"
        self.alternatives = alternatives  # runner-up first tokens a proposer that scores its guesses adds

    def pick(self, logits: torch.Tensor, constraint: TokenConstraint | None) -> tuple[int, torch.Tensor | None]:
        """logits [V] -> (token, the distribution it was drawn from or None when greedy)."""
        logits = mask_logits(logits, constraint)
        if self.greedy:
            return argmax(logits), None
        probs = self.sampler.probabilities(logits)
        return int(torch.multinomial(probs, 1, generator=self.sampler.generator)), probs


class Proposer(ABC):
    # EAGLE-style proposers read the target's last hidden state; the decoder then runs the target
    # through `hidden_states` and hands them over with `observe_features`.
    needs_target_features: bool = False
    # Whether a draft costs (next to) nothing, as an n-gram lookup's does: the engine lets such a
    # proposer draft in any batch (EngineConfig.speculative_max_batch).
    drafts_for_free: bool = False
    # Seconds the last `propose` spent bringing the proposer's own state up to the committed ids
    # (the EAGLE head's positions for the tokens decoded plainly since its last draft): work any
    # draft needs first, whose size is set by how long drafting paused, not by what the draft is
    # worth, so a probe is judged without it.
    catch_up_seconds: float = 0.0

    @abstractmethod
    def propose(self, ids: list[int], num_tokens: int, policy: DraftPolicy, constraint: TokenConstraint | None) -> Draft:
        """Up to `num_tokens` guesses for what follows `ids` (possibly none). A constraint, if given,
        must be left in the state it was found in."""

    def observe_features(self, features: torch.Tensor) -> None:
        """features [n, H]: the target's last block output at the positions its cache gained since
        the last call, in order (every committed position is handed over once)."""

    def attach(self, cache: KVCache) -> None:
        """The target's cache for this request, which holds every committed id but the last whenever
        `propose` is called (the single-sequence decoder offers it; the engine does not). Proposers
        that do not read the target's keys and values ignore it."""

    def release(self) -> None:
        """Free what the proposer holds (its draft cache); called when the request ends."""


class CachedDrafter(Proposer):
    """An autoregressive drafting model with its own KV cache, kept in step with the committed ids.

    After proposing d_0..d_{k-1} for `ids`, the draft cache holds ids + d_0..d_{k-2}; the next call
    keeps the longest prefix it shares with the new ids (the accepted drafts) and drops the rest.
    """

    def __init__(self, cache: KVCache):
        self.cache = cache
        self._cached_ids: list[int] = []  # the ids whose KV `cache` holds, in order

    @abstractmethod
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [1, S] appended to self.cache -> logits of the last position [V]."""

    def propose(self, ids: list[int], num_tokens: int, policy: DraftPolicy, constraint: TokenConstraint | None) -> Draft:
        keep = min(common_prefix_length(self._cached_ids, ids), len(ids) - 1)
        self.cache.truncate(keep)
        self._cached_ids = self._cached_ids[:keep]
        logits = self.forward(torch.tensor([ids[keep:]]))
        self._cached_ids = list(ids)
        return draft_tokens(logits, num_tokens, policy, constraint, self._extend)

    def _extend(self, token: int) -> torch.Tensor:
        logits = self.forward(torch.tensor([[token]]))
        self._cached_ids.append(token)
        return logits

    def release(self) -> None:
        self.cache.release()
        self._cached_ids = []


def draft_tokens(
    logits: torch.Tensor, num_tokens: int, policy: DraftPolicy, constraint: TokenConstraint | None,
    extend: Callable[[int], torch.Tensor | None],
) -> Draft:  # fmt: skip
    """An autoregressive drafting model's loop: pick from `logits` [V], then `extend(token)` gives the
    logits after that token (None: no room to go on), until `num_tokens` are drafted or the grammar
    ends. The draft model runs `num_tokens - 1` extensions: the last token's own logits are not needed."""
    tokens: list[int] = []
    probs: list[torch.Tensor] = []
    with DraftedPath(constraint) as path:
        while can_extend(constraint):
            token, q = policy.pick(logits, constraint)
            tokens.append(token)
            if q is not None:
                probs.append(q)
            if len(tokens) == num_tokens or not path.advance(token):
                break
            next_logits = extend(token)
            if next_logits is None:
                break
            logits = next_logits
    return Draft(tokens, torch.stack(probs) if probs else None)

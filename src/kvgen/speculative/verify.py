"""Verification: the target scores the drafted tokens in one forward, and we keep what it agrees with.

Given the target's logits at the k+1 positions (the last committed token, then each drafted token),
`verify` returns the accepted drafts followed by exactly one token from the target: the correction at
the first rejection, or a bonus token when every draft was accepted.

- Greedy: a draft is accepted when it is the target's argmax; the output is plain greedy decoding's.
- Sampling: exact rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Draft x ~ q is
  accepted with probability min(1, p(x)/q(x)); at the first rejection the token is drawn from
  norm(max(0, p - q)). The tokens are then distributed exactly as the target's p. A deterministic draft
  (prompt lookup, greedy drafting) is q = one-hot.

p at every position is the request's own processed distribution: the sampler's processors
(penalties, logit bias, min_new_tokens, the grammar) run position by position, in the state the
accepted tokens before it left them, and each returned token is recorded (logprobs) as plain
sampling would. Positions are visited only while every earlier draft was accepted, so the
processors never see a token that is not emitted. A grammar that completes ends the run.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvgen.sampling.sampler import Sampler, argmax
from kvgen.speculative.proposer import Draft


def verify(logits: torch.Tensor, draft: Draft, sampler: Sampler) -> list[int]:
    """logits [k+1, V] from the target for (last committed token, d_0, ..., d_{k-1}) -> new tokens."""
    k = len(draft.tokens)
    assert logits.shape[0] == k + 1, f"need logits for {k + 1} positions, got {logits.shape[0]}"
    return verify_each(logits.__getitem__, draft, sampler)


def verify_each(logits_at: Callable[[int], torch.Tensor], draft: Draft, sampler: Sampler) -> list[int]:
    """`verify` with the target's logits asked for one position at a time: `logits_at(i)` [V] for
    (last committed token, d_0, ..., d_{k-1})[i], called for i = 0, 1, ... only while every draft
    before position i was accepted (a caller may run the target one token per call)."""
    k = len(draft.tokens)
    out: list[int] = []
    for i in range(k + 1):
        logits = logits_at(i)
        if i == k:  # every draft accepted: one more token from the target
            pick = sampler.pick
        elif sampler.params.greedy:
            pick = argmax  # in C: torch's argmax over the vocabulary cost ~60 us a verified row
        else:
            pick = lambda scores, i=i: _accept_or_resample(sampler, scores, draft, i)  # noqa: E731
        token = sampler.choose(logits, pick)
        out.append(token)
        if i == k or token != draft.tokens[i] or _grammar_complete(sampler):
            return out
    raise AssertionError("unreachable: the loop returns at position k")


def _grammar_complete(sampler: Sampler) -> bool:
    return sampler.constraint is not None and sampler.constraint.is_finished()


def _accept_or_resample(sampler: Sampler, scores: torch.Tensor, draft: Draft, i: int) -> int:
    """One step of rejection sampling at draft position i: the draft token, or a resampled one."""
    x = draft.tokens[i]
    p = sampler.probabilities(scores)  # [V]
    if draft.probs is None:
        q = torch.zeros_like(p)
        q[x] = 1.0
    else:
        q = draft.probs[i]
    u = float(torch.rand((), generator=sampler.generator))
    if q[x] > 0 and u * float(q[x]) < float(p[x]):  # u < p/q, without dividing by a tiny q
        return x
    residual = torch.clamp(p - q, min=0)
    total = float(residual.sum())
    if total <= 0:  # p == q up to rounding: rejection had probability ~0; p is then the right law
        residual, total = p, 1.0
    return int(torch.multinomial(residual / total, 1, generator=sampler.generator))

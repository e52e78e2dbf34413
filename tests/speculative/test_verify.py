"""verify(): greedy acceptance exactly, and rejection sampling that reproduces the target's law.

The statistical tests draw many independent verifications on small explicit distributions and compare
the first returned token's counts with the target p by a chi-square statistic (critical values from
a table: scipy is not a dependency)."""

from __future__ import annotations

import torch

from kvgen.sampling.params import SamplingParams
from kvgen.sampling.sampler import Sampler
from kvgen.speculative.proposer import Draft
from kvgen.speculative.verify import verify
from tests.speculative.constraints import ForbidSet
from tests.speculative.stats import CHI2_CRITICAL_0_001, chi_square


def logits_for(p: list[float]) -> torch.Tensor:
    return torch.tensor(p).log()


def test_greedy_accepts_the_agreeing_prefix_then_corrects():
    # Target argmaxes per position: 2, 0, 1, 3. Draft says 2, 0, 3: two accepted, then the correction 1.
    logits = torch.tensor([[0, 0, 5, 0], [5, 0, 0, 0], [0, 5, 0, 0], [0, 0, 0, 5]], dtype=torch.float32)
    sampler = Sampler(SamplingParams(temperature=0))
    assert verify(logits, Draft([2, 0, 3]), sampler) == [2, 0, 1]
    assert verify(logits, Draft([2, 0, 1]), sampler) == [2, 0, 1, 3]  # all accepted: a bonus token
    assert verify(logits, Draft([1, 0, 1]), sampler) == [2]


def test_greedy_verification_obeys_the_constraint_mask():
    logits = torch.tensor([[0, 0, 5, 1], [5, 0, 0, 0]], dtype=torch.float32)
    constraint = ForbidSet({2})
    assert verify(logits, Draft([2]), Sampler(SamplingParams(), constraint=constraint)) == [3]
    assert constraint.consumed == [3]


def sampled_first_tokens(p: list[float], q: list[float] | None, trials: int, seed: int = 0) -> torch.Tensor:
    """Counts of verify's first token when x ~ q (or x = argmax q for a deterministic draft) is checked
    against target p: each trial draws the draft, then verifies it."""
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
    draw = torch.Generator().manual_seed(seed + 1)
    logits = logits_for(p)[None].repeat(2, 1)  # positions: last token, the draft
    counts = torch.zeros(len(p))
    for _ in range(trials):
        if q is None:
            draft = Draft([1])  # a lookup-style guess: q is one-hot on token 1
        else:
            x = int(torch.multinomial(torch.tensor(q), 1, generator=draw))
            draft = Draft([x], torch.tensor([q]))
        counts[verify(logits, draft, sampler)[0]] += 1
    return counts


def test_rejection_sampling_follows_the_target_with_a_sampled_draft():
    p = [0.5, 0.2, 0.15, 0.1, 0.05]
    q = [0.1, 0.1, 0.2, 0.3, 0.3]  # far from p: most drafts are rejected and resampled
    counts = sampled_first_tokens(p, q, trials=6000)
    assert chi_square(counts, torch.tensor(p)) < CHI2_CRITICAL_0_001[len(p) - 1]


def test_rejection_sampling_follows_the_target_with_a_deterministic_draft():
    p = [0.3, 0.4, 0.2, 0.1]
    counts = sampled_first_tokens(p, None, trials=6000, seed=3)
    assert chi_square(counts, torch.tensor(p)) < CHI2_CRITICAL_0_001[len(p) - 1]


def test_the_chi_square_check_rejects_a_wrong_law():
    # The statistic must be able to fail: the draft's own law q is far from p at this sample size.
    p, q = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]), torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3])
    counts = torch.bincount(torch.multinomial(q, 6000, replacement=True, generator=torch.Generator().manual_seed(0)), minlength=5)
    assert chi_square(counts.float(), p) > CHI2_CRITICAL_0_001[4]

"""SamplingParams validation and the sampler's filters, on toy logits and on the real model."""

from __future__ import annotations

import pytest
import torch

from kvgen import SamplingParams
from kvgen.sampling import Sampler


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"seed": "abc"}, "seed must be an integer"),
    ],
)
def test_invalid_parameters_are_rejected_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_filters_on_a_known_distribution() -> None:
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.10]))
    top_k = Sampler(SamplingParams(temperature=1.0, top_k=2)).probabilities(logits)
    torch.testing.assert_close(top_k, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    top_p = Sampler(SamplingParams(temperature=1.0, top_p=0.7)).probabilities(logits)
    torch.testing.assert_close(top_p, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))  # 0.5 < 0.7, 0.75 >= 0.7
    hot = Sampler(SamplingParams(temperature=2.0)).probabilities(logits)
    expected = torch.softmax(logits / 2, dim=-1)
    torch.testing.assert_close(hot, expected)


def test_greedy_needs_no_randomness() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9])
    assert Sampler(SamplingParams()).__call__(logits) == 1
    assert Sampler(SamplingParams(temperature=5.0, top_k=1)).__call__(logits) == 1


def test_top_k_one_equals_greedy_on_the_model(smollm2) -> None:
    prompt = "The three primary colors are"
    greedy = smollm2.generate(prompt, SamplingParams(max_new_tokens=16))
    top1 = smollm2.generate(prompt, SamplingParams(max_new_tokens=16, temperature=0.9, top_k=1, seed=3))
    assert top1.token_ids == greedy.token_ids


def test_same_seed_same_text_different_seed_different_text(smollm2) -> None:
    prompt = "Once upon a time"
    params = dict(max_new_tokens=24, temperature=1.0, top_p=0.95)
    first = smollm2.generate(prompt, SamplingParams(seed=7, **params))
    again = smollm2.generate(prompt, SamplingParams(seed=7, **params))
    others = {tuple(smollm2.generate(prompt, SamplingParams(seed=s, **params)).token_ids) for s in (8, 9, 10)}
    assert first.token_ids == again.token_ids
    assert any(other != tuple(first.token_ids) for other in others)

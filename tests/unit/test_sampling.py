"""SamplingParams validation, the processors on known logits, and every parameter on the real SmolLM2,
checked against a from-scratch recomputation of each step."""

from __future__ import annotations

import math

import pytest
import torch

from kvgen import SamplingParams
from kvgen.sampling import Sampler
from tests.support.recompute import greedy_from_scratch, logits_from_scratch

PROMPT = "The three primary colors are"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be >= 0"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"min_new_tokens": 9, "max_new_tokens": 8}, r"min_new_tokens must be an integer in \[0, max_new_tokens=8\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias key 'x' is not a token id"),
        ({"logit_bias": {5: float("nan")}}, r"logit_bias\[5\] must be a finite number or -inf"),
        ({"logit_bias": [1, 2]}, "logit_bias must map token ids to numbers"),
        ({"seed": "abc"}, "seed must be an integer"),
        ({"stop": ["ok", ""]}, "stop must be a string or a list of non-empty strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be non-negative integer token ids"),
        ({"top_logprobs": 3}, "top_logprobs needs logprobs=True"),
        ({"logprobs": True, "top_logprobs": 21}, r"top_logprobs must be an integer in \[0, 20\]"),
        ({"n": 0}, "n \\(samples per prompt\\) must be an integer >= 1"),
        ({"structured": {"type": "object"}}, "structured must be a StructuredOutput"),
    ],
)
def test_invalid_parameters_are_rejected_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_parameters_normalise_their_types() -> None:
    params = SamplingParams(stop="END", stop_token_ids=[3, 4], logit_bias={"7": -1, 8: float("-inf")})
    assert params.stop == ("END",) and params.stop_token_ids == (3, 4)
    assert params.logit_bias == {7: -1.0, 8: float("-inf")}


def test_vocabulary_checks_happen_before_any_work(smollm2) -> None:
    with pytest.raises(ValueError, match=r"logit_bias has token ids \[49152\] outside the vocabulary \[0, 49152\)"):
        smollm2.generate(PROMPT, SamplingParams(logit_bias={49152: 1.0}))
    with pytest.raises(ValueError, match=r"stop_token_ids has token ids \[60000\]"):
        smollm2.stream(PROMPT, SamplingParams(stop_token_ids=(60000,)))


def test_filters_on_a_known_distribution() -> None:
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.10]))
    top_k = Sampler(SamplingParams(temperature=1.0, top_k=2)).probabilities(logits)
    torch.testing.assert_close(top_k, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    top_p = Sampler(SamplingParams(temperature=1.0, top_p=0.7)).probabilities(logits)
    torch.testing.assert_close(top_p, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))  # 0.5 < 0.7, 0.75 >= 0.7
    min_p = Sampler(SamplingParams(temperature=1.0, min_p=0.3)).probabilities(logits)  # keep p >= 0.15
    torch.testing.assert_close(min_p, torch.tensor([0.5, 0.25, 0.15, 0.0]) / 0.9)
    hot = Sampler(SamplingParams(temperature=2.0)).probabilities(logits)
    torch.testing.assert_close(hot, torch.softmax(logits / 2, dim=-1))


def test_penalties_and_bias_on_known_logits() -> None:
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={3: 1.0})
    sampler = Sampler(params, prompt_ids=[0], vocab_size=4)
    sampler.processors[0].observe(1)  # token 1 generated twice, token 0 only in the prompt
    sampler.processors[0].observe(1)
    logits = torch.tensor([2.0, -1.0, 0.5, 0.0])
    out = logits.clone()
    for processor in sampler.processors:
        out = processor(out)
    # 0: prompt only -> 2/2; 1: -1*2 - 0.25*2 - 0.5; 2 untouched; 3: +1 bias.
    torch.testing.assert_close(out, torch.tensor([1.0, -3.0, 0.5, 1.0]))


def test_greedy_needs_no_randomness() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9])
    assert Sampler(SamplingParams())(logits.clone()) == 1
    assert Sampler(SamplingParams(temperature=5.0, top_k=1))(logits.clone()) == 1


@pytest.mark.slow  # recomputes every step from scratch
def test_greedy_equals_recomputation(smollm2) -> None:
    ids = smollm2.tokenizer.encode(PROMPT)
    result = smollm2.generate(ids, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert result.token_ids == greedy_from_scratch(smollm2, ids, 6)


def test_top_k_one_tiny_top_p_and_full_min_p_equal_greedy(smollm2) -> None:
    greedy = smollm2.generate(PROMPT, SamplingParams(max_new_tokens=10))
    for params in (
        SamplingParams(max_new_tokens=10, temperature=0.9, top_k=1, seed=3),
        SamplingParams(max_new_tokens=10, temperature=0.9, top_p=1e-6, seed=3),
        SamplingParams(max_new_tokens=10, temperature=0.9, min_p=1.0, seed=3),
    ):
        assert smollm2.generate(PROMPT, params).token_ids == greedy.token_ids, params


def test_same_seed_same_text_different_seed_different_text(smollm2) -> None:
    prompt = "Once upon a time"
    params = dict(max_new_tokens=16, temperature=1.0, top_p=0.95)
    first = smollm2.generate(prompt, SamplingParams(seed=7, **params))
    again = smollm2.generate(prompt, SamplingParams(seed=7, **params))
    others = {tuple(smollm2.generate(prompt, SamplingParams(seed=s, **params)).token_ids) for s in (8, 9)}
    assert first.token_ids == again.token_ids
    assert any(other != tuple(first.token_ids) for other in others)


@pytest.mark.slow  # recomputes every step from scratch
def test_top_k_samples_only_the_k_most_likely_tokens(smollm2) -> None:
    ids = smollm2.tokenizer.encode(PROMPT)
    params = SamplingParams(max_new_tokens=6, temperature=1.5, top_k=3, seed=11, ignore_eos=True, logprobs=True, top_logprobs=3)
    result = smollm2.generate(ids, params)
    for step, entry in enumerate(result.logprobs):
        reference = torch.log_softmax(logits_from_scratch(smollm2, ids + result.token_ids[:step]), dim=-1)
        assert entry.token_id in torch.topk(reference, 3).indices.tolist()
        assert entry.logprob == pytest.approx(float(reference[entry.token_id]), abs=1e-3)
        assert [t for t, _ in entry.top] == torch.topk(reference, 3).indices.tolist()


@pytest.mark.slow  # recomputes every step from scratch
def test_logit_bias_bans_and_forces_tokens(smollm2) -> None:
    greedy = smollm2.generate(PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True))
    banned = greedy.token_ids[0]
    result = smollm2.generate(PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True, logit_bias={banned: float("-inf")}))
    assert banned not in result.token_ids
    ids = smollm2.tokenizer.encode(PROMPT)
    ban = lambda logits, generated: logits.index_fill(0, torch.tensor([banned]), float("-inf"))  # noqa: E731
    assert result.token_ids == greedy_from_scratch(smollm2, ids, 8, ban)
    forced = smollm2.tokenizer.encode(" banana", add_special_tokens=False)[0]
    result = smollm2.generate(PROMPT, SamplingParams(max_new_tokens=4, logit_bias={forced: 100.0}))
    assert result.token_ids == [forced] * 4


def _reference_penalties(prompt_ids: list[int], repetition: float, presence: float, frequency: float):
    """Penalties written out per token id, independently of kvgen's tensor code."""

    def transform(logits: torch.Tensor, generated: list[int]) -> torch.Tensor:
        out = logits.clone()
        for token in set(prompt_ids) | set(generated):
            out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
        for token in set(generated):
            out[token] -= presence + frequency * generated.count(token)
        return out

    return transform


@pytest.mark.slow  # recomputes every step from scratch
@pytest.mark.parametrize(
    ("repetition", "presence", "frequency"), [(1.3, 0.0, 0.0), (1.0, 1.5, 0.0), (1.0, 0.0, 0.7), (1.2, 0.4, 0.3)]
)
def test_penalties_equal_the_reference(smollm2, repetition: float, presence: float, frequency: float) -> None:
    ids = smollm2.tokenizer.encode("one two one two one two one")
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, repetition_penalty=repetition,
                            presence_penalty=presence, frequency_penalty=frequency)  # fmt: skip
    result = smollm2.generate(ids, params)
    assert result.token_ids == greedy_from_scratch(smollm2, ids, 6, _reference_penalties(ids, repetition, presence, frequency))


def test_repetition_penalty_changes_a_repetitive_continuation(smollm2) -> None:
    ids = smollm2.tokenizer.encode("one two one two one two one")
    plain = smollm2.generate(ids, SamplingParams(max_new_tokens=6, ignore_eos=True))
    penalised = smollm2.generate(ids, SamplingParams(max_new_tokens=6, ignore_eos=True, repetition_penalty=1.5))
    assert plain.token_ids != penalised.token_ids


def test_min_new_tokens_holds_off_eos(smollm2) -> None:
    prompt = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    ids = smollm2.tokenizer.encode(prompt, add_special_tokens=False)
    short = smollm2.generate(ids, SamplingParams(max_new_tokens=64))
    assert short.finish_reason == "stop"
    at_least = len(short.token_ids) + 3
    longer = smollm2.generate(ids, SamplingParams(max_new_tokens=64, min_new_tokens=at_least))
    eos = set(smollm2.tokenizer.eos_token_ids)
    assert len(longer.token_ids) >= at_least
    assert not eos & set(longer.token_ids[: at_least - 1])
    assert longer.token_ids[: len(short.token_ids) - 1] == short.token_ids[:-1]  # same until EOS was due


@pytest.mark.slow  # recomputes every step from scratch
def test_logprobs_equal_recomputation(smollm2) -> None:
    ids = smollm2.tokenizer.encode(PROMPT)
    result = smollm2.generate(ids, SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=2))
    assert len(result.logprobs) == 4
    for step, entry in enumerate(result.logprobs):
        reference = torch.log_softmax(logits_from_scratch(smollm2, ids + result.token_ids[:step]), dim=-1)
        assert entry.token_id == result.token_ids[step]
        assert entry.logprob == pytest.approx(float(reference.max()), abs=1e-3)  # greedy: the best token
        assert entry.top[0][0] == entry.token_id and len(entry.top) == 2
        assert math.exp(entry.top[0][1]) + math.exp(entry.top[1][1]) <= 1.0 + 1e-5
    assert smollm2.generate(ids, SamplingParams(max_new_tokens=2)).logprobs is None


@pytest.mark.slow  # recomputes every step from scratch
def test_n_samples_prefill_once_and_equal_single_runs(smollm2, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = smollm2.tokenizer.encode("Once upon a time")
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=21, n=3, ignore_eos=True)
    seen_tokens: list[int] = []
    forward = smollm2.model.forward

    def counting_forward(input_ids, cache, *args, **kwargs):
        seen_tokens.append(input_ids.shape[1])
        return forward(input_ids, cache, *args, **kwargs)

    monkeypatch.setattr(smollm2.model, "forward", counting_forward)
    samples = smollm2.generate_n(ids, params)
    monkeypatch.undo()
    assert len(samples) == 3
    assert seen_tokens.count(len(ids)) == 1 and sum(seen_tokens) == len(ids) + 3 * 5  # one prefill, then decode steps
    assert [s.timings.prefill_tokens for s in samples] == [len(ids), 0, 0]
    assert [s.usage.cached_tokens for s in samples] == [0, len(ids), len(ids)]
    for i, sample in enumerate(samples):
        single = smollm2.generate(ids, SamplingParams(max_new_tokens=6, temperature=1.0, seed=21 + i, ignore_eos=True))
        assert sample.token_ids == single.token_ids
    assert len({tuple(s.token_ids) for s in samples}) > 1
    with pytest.raises(ValueError, match="call generate_n"):
        smollm2.generate(ids, params)

"""RequestState, the one per-request state of Generator, the engine, generate_batch and the server,
driven token by token on the real SmolLM2 and compared with `LLM.generate`."""

from __future__ import annotations

import pytest
import torch

from kvgen import LLM, SamplingParams
from kvgen.sampling.request_state import RequestState

PROMPT = "The three primary colors are"


def decode(llm: LLM, params: SamplingParams) -> tuple[RequestState, list]:
    """A plain greedy loop: the model on a fresh cache, RequestState sampling and appending one token
    at a time; returns the state and every delta."""
    ids = llm.tokenizer.encode(PROMPT)
    gen = llm.generator
    state = RequestState(params, llm.tokenizer, ids, llm.model.config.vocab_size, gen.max_context)
    cache = gen.new_cache(len(ids) + params.max_new_tokens)
    deltas = []
    with torch.inference_mode():
        logits = llm.model(torch.tensor([ids]), cache)[0, -1]
        while True:
            token = state.sampler(logits)
            deltas.append(state.append([token]))
            if deltas[-1].finished:
                break
            logits = llm.model(torch.tensor([[token]]), cache)[0, -1]
    cache.release()
    return state, deltas


def test_token_by_token_deltas_add_up_to_the_generate_result(smollm2: LLM) -> None:
    params = SamplingParams(max_new_tokens=16, logprobs=True, top_logprobs=2)
    state, deltas = decode(smollm2, params)
    expected = smollm2.generate(PROMPT, params)
    result = state.result()
    assert result.token_ids == expected.token_ids
    assert "".join(d.text for d in deltas) == result.text == expected.text
    assert [t for d in deltas for t in d.token_ids] == result.token_ids
    assert [lp.token_id for d in deltas for lp in d.logprobs] == result.token_ids
    assert [lp.logprob for lp in result.logprobs] == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-4)
    assert (result.finish_reason, deltas[-1].finish_reason) == ("length", "length")
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(smollm2.tokenizer.encode(PROMPT)), 16)
    assert result.usage == expected.usage


def test_stop_string_across_tokens_is_held_back_then_cut(smollm2: LLM) -> None:
    free = smollm2.generate(PROMPT, SamplingParams(max_new_tokens=16))
    pieces = [smollm2.tokenizer.decode(free.token_ids[:i]) for i in range(len(free.token_ids) + 1)]
    # A stop string that starts inside one token's text and ends inside a later one's.
    cut = next(i for i in range(4, len(free.token_ids)) if len(pieces[i]) - len(pieces[i - 1]) >= 2)
    start = len(pieces[cut]) - 1
    stop = free.text[start : start + 3]
    assert stop not in free.text[: start + 2], "the stop must first match where it was cut"
    params = SamplingParams(max_new_tokens=16, stop=(stop,))
    state, deltas = decode(smollm2, params)
    result = state.result()
    assert result.text == free.text[:start] == smollm2.generate(PROMPT, params).text
    assert (result.finish_reason, result.stop_reason) == ("stop", stop)
    # Held back while it could still become the stop: no delta ever emits text past where it starts.
    emitted = ["".join(d.text for d in deltas[:k]) for k in range(len(deltas) + 1)]
    assert all(free.text[:start].startswith(text) for text in emitted)


def test_a_verified_run_appended_at_once_equals_one_at_a_time(smollm2: LLM) -> None:
    params = SamplingParams(max_new_tokens=12)
    tokens = smollm2.generate(PROMPT, params).token_ids
    ids = smollm2.tokenizer.encode(PROMPT)
    vocab, context = smollm2.model.config.vocab_size, smollm2.generator.max_context
    one = RequestState(params, smollm2.tokenizer, ids, vocab, context)
    singles = [one.append([t]) for t in tokens]
    runs = RequestState(params, smollm2.tokenizer, ids, vocab, context)
    batched = [runs.append(tokens[i : i + 5]) for i in range(0, len(tokens), 5)]
    assert "".join(d.text for d in batched) == "".join(d.text for d in singles) == one.result().text
    assert runs.result().token_ids == one.result().token_ids == tokens
    assert batched[-1].finish_reason == singles[-1].finish_reason == "length"


def test_tokens_after_the_finishing_one_are_dropped_and_nothing_appends_after(smollm2: LLM) -> None:
    params = SamplingParams(max_new_tokens=3)
    ids = smollm2.tokenizer.encode(PROMPT)
    state = RequestState(params, smollm2.tokenizer, ids, smollm2.model.config.vocab_size, smollm2.generator.max_context)
    delta = state.append([ids[0], ids[1], ids[2], ids[3], ids[4]])  # a run longer than the budget
    assert delta.token_ids == ids[:3] and delta.finish_reason == "length"
    assert state.result().usage.completion_tokens == 3
    with pytest.raises(ValueError, match="already finished"):
        state.append([ids[0]])


def test_a_stop_id_ends_the_request_without_text(smollm2: LLM) -> None:
    ids = smollm2.tokenizer.encode(PROMPT)
    stop_id = smollm2.tokenizer.encode(" red")[0]
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(stop_id,))
    state = RequestState(params, smollm2.tokenizer, ids, smollm2.model.config.vocab_size, smollm2.generator.max_context)
    first = state.append([ids[1]])
    last = state.append([stop_id])
    assert last.finish_reason == "stop" and state.stopped_on_token
    assert state.result().text == first.text + last.text == smollm2.tokenizer.decode([ids[1]])
    assert state.result().stop_reason == stop_id

"""Generator and Session on the real SmolLM2: streaming, stopping, usage, cache reuse across turns."""

from __future__ import annotations

import pytest
import torch

from kvgen import SamplingParams
from kvgen.token_ids import common_prefix_length


def test_stream_chunks_add_up_to_the_result(smollm2) -> None:
    stream = smollm2.stream("Write a short poem about the sea:", SamplingParams(max_new_tokens=40))
    chunks = list(stream)
    result = stream.result
    assert "".join(c.text for c in chunks) == result.text
    ids = [t for t in result.token_ids if t not in smollm2.tokenizer.eos_token_ids]
    assert result.text == smollm2.tokenizer.decode(ids)
    assert result.usage.completion_tokens == len(result.token_ids)
    assert result.usage.prompt_tokens == len(smollm2.tokenizer.encode("Write a short poem about the sea:"))
    assert result.timings.prefill_tokens == result.usage.prompt_tokens
    assert result.timings.decode_tokens == len(result.token_ids) - 1


def test_max_new_tokens_and_finish_reason(smollm2) -> None:
    result = smollm2.generate("Once upon a time", SamplingParams(max_new_tokens=5))
    assert len(result.token_ids) == 5 and result.finish_reason == "length"


def test_eos_stops_generation(smollm2) -> None:
    prompt = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    result = smollm2.generate(smollm2.tokenizer.encode(prompt, add_special_tokens=False), SamplingParams(max_new_tokens=200))
    assert result.finish_reason == "stop"
    assert result.token_ids[-1] in smollm2.tokenizer.eos_token_ids
    assert "<|im_end|>" not in result.text


def test_stop_token_ids_stop_early(smollm2) -> None:
    full = smollm2.generate("Once upon a time", SamplingParams(max_new_tokens=12))
    stop_at = full.token_ids[5]
    cut = smollm2.generate("Once upon a time", SamplingParams(max_new_tokens=12, stop_token_ids=(stop_at,)))
    assert cut.token_ids == full.token_ids[: full.token_ids.index(stop_at) + 1]
    assert cut.finish_reason == "stop"


def test_generation_stops_at_the_context_end(smollm2) -> None:
    from kvgen.generate import Generator

    small = Generator(smollm2.model, smollm2.tokenizer, max_context=20)
    ids = smollm2.tokenizer.encode("Once upon a time")
    result = small.generate(ids, SamplingParams(max_new_tokens=100, ignore_eos=True))
    assert len(ids) + len(result.token_ids) == 20 and result.finish_reason == "length"


def test_bad_prompts(smollm2) -> None:
    with pytest.raises(ValueError, match="the prompt is empty"):
        smollm2.generate([])
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 49152\)"):
        smollm2.generate([1, 49152])


def test_session_second_turn_prefills_only_new_tokens_and_matches_fresh_run(smollm2) -> None:
    session = smollm2.session()
    params = SamplingParams(max_new_tokens=16)
    first = "".join(c.text for c in session.chat("Name a fruit.", params))
    turn1 = session.last_result
    assert turn1 is not None and first == turn1.text
    list(session.chat("Name a vegetable.", params))
    turn2 = session.last_result
    prompt2 = smollm2.tokenizer.apply_chat_template(session.messages[:-1])
    prompt2_ids = smollm2.tokenizer.encode(prompt2, add_special_tokens=False)
    assert turn2.usage.prompt_tokens == len(prompt2_ids)
    assert turn2.usage.cached_tokens >= turn1.usage.prompt_tokens + len(turn1.token_ids) - 2
    assert turn2.timings.prefill_tokens == turn2.usage.prompt_tokens - turn2.usage.cached_tokens
    fresh = smollm2.generate(prompt2_ids, params)
    assert fresh.token_ids == turn2.token_ids


def test_session_rewinds_to_a_shorter_prompt(smollm2) -> None:
    session = smollm2.session()
    params = SamplingParams(max_new_tokens=8)
    long_ids = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog. The end")
    list(session.stream(long_ids, params))
    short_ids = long_ids[:5]
    stream = session.stream(short_ids, params)
    list(stream)
    assert stream.result.usage.cached_tokens == 4  # the last prompt token is always recomputed
    assert stream.result.token_ids == smollm2.generate(short_ids, params).token_ids


def test_failed_forward_leaves_the_cache_unchanged(smollm2, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = smollm2.generator.new_cache(64)
    ids = smollm2.tokenizer.encode("Hello there, how are you")
    with torch.inference_mode():
        smollm2.model(torch.tensor([ids]), cache)
    before = cache.seq_len
    block = smollm2.model.layers[15]

    def explode(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(block, "forward", explode)
    with pytest.raises(RuntimeError, match="injected"), torch.inference_mode():
        smollm2.model(torch.tensor([[42, 43]]), cache)
    assert cache.seq_len == before
    monkeypatch.undo()
    with torch.inference_mode():
        resumed = smollm2.model(torch.tensor([[42]]), cache)[0, -1]
        fresh = smollm2.model(torch.tensor([ids + [42]]), smollm2.generator.new_cache(64))[0, -1]
    torch.testing.assert_close(resumed, fresh, rtol=0, atol=1e-4)


def test_common_prefix_length() -> None:
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0

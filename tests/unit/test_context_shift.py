"""remove_range + re-rotation (context shift): exact for what can be exact, and generation goes on."""

from __future__ import annotations

import pytest
import torch

from kvgen import LLM, SamplingParams
from kvgen.generate import Generator
from kvgen.kv import CacheSpec, ContiguousCache
from tests.support.models import model_path


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_layer0_after_remove_range_equals_a_fresh_prefill_of_the_shorter_text(name: str) -> None:
    """Layer 0's keys and values depend only on each token itself, so once re-rotated to their new
    positions they must be exactly what a prefill of the shortened sequence computes."""
    llm = LLM.load(model_path(name), progress=False, weights="fp32")
    ids = llm.tokenizer.encode("One two three four five six seven eight nine ten eleven twelve thirteen")
    spec = CacheSpec.for_model(llm.config)
    with torch.inference_mode():
        shifted = ContiguousCache(spec, 64)
        llm.model(torch.tensor([ids]), shifted)
        shifted.remove_range(2, 7, llm.model.rerotate)
        fresh = ContiguousCache(spec, 64)
        llm.model(torch.tensor([ids[:2] + ids[7:]]), fresh)
    assert shifted.seq_len == fresh.seq_len == len(ids) - 5
    n = fresh.seq_len  # deeper layers saw the removed tokens, so only layer 0 can match exactly
    # 1e-4: a 9-row and a 14-row matmul round differently (values, which are not rotated, differ by 2e-5).
    torch.testing.assert_close(shifted._keys[0, :, :, :n], fresh._keys[0, :, :, :n], rtol=0, atol=1e-4)
    torch.testing.assert_close(shifted._values[0, :, :, :n], fresh._values[0, :, :, :n], rtol=0, atol=1e-4)


def test_rerotation_composes_like_rope(smollm2) -> None:
    model = smollm2.model
    torch.manual_seed(0)
    raw = torch.randn(1, 3, 1, model.config.head_dim)
    at = lambda p: model.rerotate(0, raw, p)  # noqa: E731  rotation from position 0 to p
    torch.testing.assert_close(model.rerotate(0, at(900), -700), at(200), rtol=0, atol=1e-4)


def test_generation_continues_past_the_context_with_shift(smollm2) -> None:
    small = Generator(smollm2.model, smollm2.tokenizer, max_context=48)
    ids = smollm2.tokenizer.encode("Once upon a time, in a small village by the sea, there lived")
    stopped = small.generate(ids, SamplingParams(max_new_tokens=100, ignore_eos=True))
    assert stopped.finish_reason == "length" and len(ids) + len(stopped.token_ids) == 48
    stream = small.stream(ids, SamplingParams(max_new_tokens=100, ignore_eos=True, context_shift=True))
    text = "".join(chunk.text for chunk in stream)
    assert len(stream.result.token_ids) == 100 and stream.shifted > 0
    assert stream.result.token_ids[: len(stopped.token_ids)] == stopped.token_ids  # same until the first shift
    assert stream.cache.seq_len <= 48 and len(text) > 200


def test_caches_that_cannot_move_positions_say_so() -> None:
    from kvgen.kv.quantized import QuantizedCache

    with pytest.raises(NotImplementedError, match="QuantizedCache cannot remove a range"):
        QuantizedCache(CacheSpec(1, 1, 2), 4, 8, "int8", "int8").remove_range(0, 1, lambda layer, k, d: k)

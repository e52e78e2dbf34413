"""EncoderCache against a real cross-attention: transformers' T5, built tiny with random weights."""

from __future__ import annotations

import pytest
import torch

from kvgen.kv.encoder import EncoderCache, LayerKV

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def t5():
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3,
                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config).eval()


def cross_kv(model) -> "callable":
    """The cache's `compute`: each decoder layer's own cross-attention K and V projections."""

    def compute(encoder_states: torch.Tensor) -> LayerKV:
        out = []
        for block in model.decoder.block:
            attention = block.layer[1].EncDecAttention
            shape = (*encoder_states.shape[:-1], -1, attention.key_value_proj_dim)
            out.append((attention.k(encoder_states).view(shape).transpose(1, 2),
                        attention.v(encoder_states).view(shape).transpose(1, 2)))  # fmt: skip
        return out

    return compute


def decode_logits(model, encoder_states: torch.Tensor, decoder_ids: torch.Tensor, cross: LayerKV | None) -> torch.Tensor:
    """Decoder logits, with the cross-attention K/V taken from `cross` (None: the model computes them)."""
    from transformers import DynamicCache, EncoderDecoderCache

    past = None
    if cross is not None:
        cross_cache = DynamicCache()
        for layer, (k, v) in enumerate(cross):
            cross_cache.update(k, v, layer)
        past = EncoderDecoderCache(DynamicCache(), cross_cache)
    out = model(encoder_outputs=(encoder_states,), decoder_input_ids=decoder_ids, past_key_values=past, use_cache=True)
    return out.logits, out.past_key_values


@torch.inference_mode()
def test_cached_kv_equals_t5_cross_attention_and_a_second_request_hits(t5) -> None:
    calls = []
    compute = cross_kv(t5)
    cache = EncoderCache(lambda states: calls.append(1) or compute(states), "t5-tiny", budget_bytes=1 << 20)
    input_ids = torch.tensor([[5, 9, 13, 2, 7, 31]])
    encoder_states = t5.encoder(input_ids=input_ids).last_hidden_state  # [1, 6, 32]
    decoder_ids = torch.tensor([[0, 4, 17]])
    want_logits, model_cache = decode_logits(t5, encoder_states, decoder_ids, None)
    with cache.acquire(encoder_states) as first:
        assert not first.hit
        for layer, (k, v) in enumerate(first.layers):  # exactly what T5's own cross-attention computed
            assert torch.equal(k, model_cache.cross_attention_cache.layers[layer].keys)
            assert torch.equal(v, model_cache.cross_attention_cache.layers[layer].values)
        got_logits, _ = decode_logits(t5, encoder_states, decoder_ids, first.layers)
        torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=0)
    # A second request on the same input, at other decoder positions (position independence): a hit.
    with cache.acquire(encoder_states.clone()) as second:
        assert second.hit and len(calls) == 1
        longer = torch.tensor([[0, 4, 17, 8, 8]])
        got_logits, _ = decode_logits(t5, encoder_states, longer, second.layers)
        torch.testing.assert_close(got_logits, decode_logits(t5, encoder_states, longer, None)[0], rtol=0, atol=0)
    assert cache.stats == {"hits": 1, "misses": 1, "evictions": 0}
    cache.check_invariants()


def test_keys_separate_inputs_models_and_dtypes() -> None:
    states = torch.arange(12.0).reshape(1, 3, 4)
    key = EncoderCache.key_for(states, "m")
    assert key == EncoderCache.key_for(states.clone(), "m")
    assert key != EncoderCache.key_for(states, "m-lora")  # another adapter projects differently
    assert key != EncoderCache.key_for(states.reshape(1, 4, 3), "m")  # same bytes, other shape
    assert key != EncoderCache.key_for(states.double(), "m")
    changed = states.clone()
    changed[0, 2, 3] += 1
    assert key != EncoderCache.key_for(changed, "m")


def test_lru_eviction_under_the_budget_spares_entries_in_use() -> None:
    entry_bytes = 2 * 4 * 8 * 4  # one layer, K and V [1, 1, 8, 4] fp32
    compute = lambda states: [(states.reshape(1, 1, 8, 4).clone(), states.reshape(1, 1, 8, 4) * 2)]  # noqa: E731
    cache = EncoderCache(compute, "m", budget_bytes=2 * entry_bytes)
    inputs = [torch.full((1, 8, 4), float(i)) for i in range(4)]
    a, b = cache.acquire(inputs[0]), cache.acquire(inputs[1])
    c = cache.acquire(inputs[2])  # three in use: over budget, but nothing may be evicted
    assert len(cache) == 3 and cache.memory_bytes() == 3 * entry_bytes
    a.release()  # now evictable, and the cache is over budget: it goes
    assert inputs[0] not in cache and cache.stats["evictions"] == 1
    b.release()
    b.release()  # a second release of the same handle is a no-op
    c.release()
    cache.acquire(inputs[1]).release()  # touch b: c is now the least recently used
    cache.acquire(inputs[3]).release()
    assert inputs[2] not in cache and inputs[1] in cache and inputs[3] in cache
    cache.check_invariants()


def test_a_failing_compute_stores_nothing() -> None:
    def broken(states: torch.Tensor) -> LayerKV:
        raise RuntimeError("projection failed")

    cache = EncoderCache(broken, "m", budget_bytes=1024)
    with pytest.raises(RuntimeError, match="projection failed"):
        cache.acquire(torch.zeros(1, 2, 4))
    assert len(cache) == 0 and cache.stats["misses"] == 0
    with pytest.raises(ValueError, match="budget_bytes must be positive"):
        EncoderCache(broken, "m", budget_bytes=0)

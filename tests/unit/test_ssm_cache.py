"""SSMStateCache against a real recurrence: transformers' Mamba, built tiny with random weights."""

from __future__ import annotations

import pytest
import torch

from kvgen.kv.ssm import SSMSpec, SSMStateCache

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mamba():
    config = transformers.MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=3, conv_kernel=4,
                                      expand=2, use_mambapy=False)  # fmt: skip
    torch.manual_seed(0)
    return transformers.MambaForCausalLM(config).eval()


def spec_for(model) -> SSMSpec:
    c = model.config
    return SSMSpec(c.num_hidden_layers, (1, c.intermediate_size, c.conv_kernel), (1, c.intermediate_size, c.state_size))


def hf_cache_from(model, cache: SSMStateCache):
    """A transformers cache holding our cache's current state (the glue a Mamba model in kvgen would not need)."""
    hf = transformers.DynamicCache(config=model.config)
    for layer in range(cache.spec.num_layers):
        held = hf.layers[layer]
        held.lazy_initialization(conv_states=cache.conv_state(layer), recurrent_states=cache.recurrent_state(layer),
                                 conv_kernel_size=model.config.conv_kernel)  # fmt: skip
        held.conv_states[0].copy_(cache.conv_state(layer))
        held.recurrent_states[0].copy_(cache.recurrent_state(layer))
        held.has_previous_state[0] = True
    return hf


def run(model, cache: SSMStateCache, tokens: list[int]) -> torch.Tensor:
    """Feed `tokens` (one pass from the empty state, else one token at a time: transformers' scan
    starts from zero, only its one-token step continues a state); store states; last logits."""
    chunks = [tokens] if cache.seq_len == 0 else [[t] for t in tokens]
    for chunk in chunks:
        hf = transformers.DynamicCache(config=model.config) if cache.seq_len == 0 else hf_cache_from(model, cache)
        logits = model(torch.tensor([chunk]), cache_params=hf, use_cache=True).logits[0, -1]
        for layer in range(cache.spec.num_layers):
            cache.write(layer, hf.layers[layer].conv_states[0], hf.layers[layer].recurrent_states[0])
        cache.commit(len(chunk))
    return logits


@torch.inference_mode()
def test_resume_from_a_checkpoint_equals_a_from_scratch_run(mamba) -> None:
    generator = torch.Generator().manual_seed(1)
    first = torch.randint(0, 64, (20,), generator=generator).tolist()
    second = first[:15] + torch.randint(0, 64, (6,), generator=generator).tolist()  # shares 15 tokens
    cache = SSMStateCache(spec_for(mamba), checkpoint_every=4)
    run(mamba, cache, first[:5])
    run(mamba, cache, first[5:])
    assert cache.checkpoints == [0, 5, 9, 13, 17] and cache.seq_len == 20
    cache.check_invariants()

    resumed = cache.fork()
    start = resumed.resume(15)  # the latest checkpoint within the shared prefix
    assert start == 13 and resumed.seq_len == 13 and resumed.checkpoints == [0, 5, 9, 13]
    got = run(mamba, resumed, second[start:])
    scratch = mamba(torch.tensor([second])).logits[0, -1]
    torch.testing.assert_close(got, scratch, rtol=1e-4, atol=1e-5)
    assert cache.seq_len == 20 and cache.checkpoints[-1] == 17  # the fork left the original alone
    resumed.check_invariants()


def test_truncate_only_to_checkpoints_and_on_demand_checkpoints() -> None:
    spec = SSMSpec(2, (1, 3, 2), (1, 3, 4))
    cache = SSMStateCache(spec, checkpoint_every=100)
    for step in range(1, 8):
        for layer in range(2):
            cache.write(layer, torch.full(spec.conv_shape, float(step)), torch.full(spec.state_shape, float(-step)))
        cache.commit(1)
        if step == 3:
            cache.checkpoint()
    with pytest.raises(ValueError, match="nearest checkpoint is 3; truncate to 3"):
        cache.truncate(5)
    assert cache.seq_len == 7 and cache.conv_state(0)[0, 0, 0] == 7  # the refused truncate changed nothing
    cache.truncate(3)
    assert cache.conv_state(1)[0, 0, 0] == 3 and cache.recurrent_state(1)[0, 0, 0] == -3
    assert cache.memory_bytes() == 2 * spec.bytes_per_snapshot  # live state + one checkpoint
    cache.reset()
    assert cache.seq_len == 0 and cache.conv_state(0).abs().sum() == 0 and cache.checkpoints == [0]


def test_a_pass_that_fails_half_way_changes_nothing() -> None:
    spec = SSMSpec(2, (1, 3, 2), (1, 3, 4))
    cache = SSMStateCache(spec)
    cache.write(0, torch.ones(spec.conv_shape), torch.ones(spec.state_shape))
    with pytest.raises(ValueError, match=r"no state for layers \[1\]"):
        cache.commit(1)
    with pytest.raises(ValueError, match="do not match the cache's"):
        cache.write(1, torch.ones(1, 3, 3), torch.ones(spec.state_shape))
    cache.truncate(0)  # drops what the failed pass staged
    assert cache.seq_len == 0 and cache.conv_state(0).abs().sum() == 0
    cache.check_invariants()

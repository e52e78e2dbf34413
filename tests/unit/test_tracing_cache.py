"""TracingCache records what the model and generator do to a cache, in order."""

from __future__ import annotations

import torch

from kvgen.kv import CacheSpec, ContiguousCache
from kvgen.kv.tracing import CacheOp, TracingCache


def test_a_prefill_and_two_decode_steps_on_the_real_model(smollm2) -> None:
    model = smollm2.model  # fp32 weights: the torch path, one update per layer
    cache = TracingCache(ContiguousCache(CacheSpec.for_model(model.config), 32))
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3, 4, 5]]), cache)
        model(torch.tensor([[6]]), cache)
        model(torch.tensor([[7]]), cache)
    layers = model.config.num_layers
    assert cache.summary() == {"update": 3 * layers, "commit": 3}
    assert cache.ops[0] == CacheOp("update", 0, 5, 0)
    assert cache.ops[layers] == CacheOp("commit", None, 5, 0)
    assert cache.ops[layers + 1] == CacheOp("update", 0, 1, 5)
    assert cache.seq_len == 7


def test_the_log_is_bounded() -> None:
    cache = TracingCache(ContiguousCache(CacheSpec(1, 1, 2), 8), max_ops=3)
    for _ in range(5):
        cache.truncate(0)
    assert len(cache.ops) == 3

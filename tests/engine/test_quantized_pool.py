"""The engine on a pool of K/V codes (kv/paged_codes.py) with the real SmolLM2: greedy output equals
the single-sequence quantized cache's with the same format, batched or alone, in one prefill or in
chunks; the C kernels over the codes agree with the torch path; prefix hits, preemption and
failures lose nothing and leak no block or staging slot; options the pool cannot honour are refused."""

from __future__ import annotations

import pytest
import torch

from kvgen import CacheConfig, SamplingParams
from kvgen.cache_factory import CacheFactory
from kvgen.engine import EngineConfig, LLMEngine, RequestStatus
from kvgen.kv.paged_codes import QuantizedPagedStorage
from kvgen.kv.paged_codes_batch import StorageDescriptors
from kvgen.kv.paged_codes_cache import QuantizedPagedCache
from kvgen.kv.quantized import QuantizedCache
from tests.support.models import PROMPTS

FORMATS = [("int8", "int8"), ("int4", "int4")]  # fp8/fp16 and bf16 codecs: tests/unit/test_paged_codes.py
NEW_TOKENS = 16


def quantized(k: str, v: str) -> CacheConfig:
    return CacheConfig("quantized", k_dtype=k, v_dtype=v)


def single_sequence(llm, prompt: str, k: str, v: str, chunk: int | None = None, block_size: int = 16) -> list[int]:
    """Greedy tokens with a QuantizedCache of the same codecs, no residual window, the same block
    size; the prompt prefilled in chunks of `chunk` tokens as the engine's token budget cuts it."""
    factory = CacheFactory(CacheConfig(), llm.model, llm.tokenizer, 512)
    template = factory.quantized(8, k, v)
    cache = QuantizedCache(template.spec, 64, 512, template.key_codec, template.value_codec, residual=0,
                           key_rope=template.key_rope, block_tokens=block_size)  # fmt: skip
    ids, tokens = llm.tokenizer.encode(prompt), []
    chunk = chunk or len(ids)
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            last = llm.model(torch.tensor([ids[start : start + chunk]]), cache)[:, -1]
        for _ in range(NEW_TOKENS):
            tokens.append(int(last.argmax(-1)))
            last = llm.model(torch.tensor([[tokens[-1]]]), cache)[:, -1]
    return tokens


def drain(engine: LLMEngine, requests) -> None:
    while any(r.status is not RequestStatus.FINISHED for r in requests):
        engine.step()
        engine.check_invariants()
        engine.storage.check_invariants()


def assert_nothing_leaked(engine: LLMEngine) -> None:
    engine.check_invariants()
    engine.scheduler.prefix.clear()
    storage = engine.storage
    assert storage.pool.num_free == storage.pool.num_blocks and storage.num_free_slots == storage.num_slots


@pytest.fixture
def torch_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's torch path: histories decoded and SDPA (the reference for the C kernels)."""
    monkeypatch.setattr(StorageDescriptors, "for_storage", staticmethod(lambda storage: None))


@pytest.mark.slow
@pytest.mark.parametrize("k,v", FORMATS)
def test_batched_requests_equal_the_single_sequence_quantized_cache(smollm2, torch_attention, k: str, v: str) -> None:
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=64, max_num_seqs=8), quantized(k, v))
    assert isinstance(engine.storage, QuantizedPagedStorage)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    drain(engine, requests)
    for request, prompt in zip(requests, PROMPTS):
        assert request.output_ids == single_sequence(smollm2, prompt, k, v), prompt
    assert_nothing_leaked(engine)


@pytest.mark.slow
def test_chunked_prefill_across_blocks_equals_the_same_chunks_alone(smollm2, torch_attention) -> None:
    """A 60-token prompt in chunks of 24 (each chunk starts inside a block, encodes blocks the
    chunk fills whole, and stages the last one)."""
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 6)
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=64, max_tokens_per_step=24), quantized("int4", "int8"))
    request = engine.add_request("long", prompt, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    drain(engine, [request])
    assert len(request.prompt_ids) > 48
    assert request.output_ids == single_sequence(smollm2, prompt, "int4", "int8", chunk=24)
    assert_nothing_leaked(engine)


@pytest.mark.slow
@pytest.mark.parametrize("k,v", [("int4", "int8")])
def test_kernel_over_codes_agrees_with_the_torch_path(smollm2, k: str, v: str, monkeypatch) -> None:
    """Rows of different lengths, prefilled then decoded together: the logits of the C kernel over
    the codes and of SDPA over the decoded histories differ only by summation order."""
    model = smollm2.model
    prompts = [smollm2.tokenizer.encode(p) for p in PROMPTS[:3]]

    def run() -> torch.Tensor:
        engine = LLMEngine(smollm2, EngineConfig(num_blocks=64), quantized(k, v))
        caches = [engine.scheduler.new_cache() for _ in prompts]
        assert all(isinstance(c, QuantizedPagedCache) for c in caches)
        logits, rows = [], [list(p) for p in prompts]
        with torch.inference_mode():
            for _ in range(6):
                out = model.forward_batch(rows, caches)  # [B, V]
                logits.append(out)
                rows = [[int(t)] for t in out.argmax(-1)]
        for cache in caches:
            cache.release()
        return torch.stack(logits)

    kernel = run()
    monkeypatch.setattr(StorageDescriptors, "for_storage", staticmethod(lambda storage: None))
    reference = run()
    assert (kernel - reference).abs().max() < 1e-3
    assert torch.equal(kernel.argmax(-1), reference.argmax(-1))


@pytest.mark.slow
def test_decode_rows_over_codes_read_no_history(smollm2_q4, monkeypatch) -> None:
    """4-bit weights: decode steps run every layer in one C call over the codes; nothing decodes
    a history (`history` is the torch path's read) and the text is the same as in a cold engine."""
    engine = LLMEngine(smollm2_q4, EngineConfig(num_blocks=64), quantized("int8", "int4"))
    reads: list[int] = []
    real_history = QuantizedPagedCache.history
    monkeypatch.setattr(QuantizedPagedCache, "history", lambda self, layer, n: reads.append(n) or real_history(self, layer, n))
    requests = [engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=24, ignore_eos=True)) for i, p in enumerate(PROMPTS[:3])]
    drain(engine, requests)
    assert reads == []
    assert all(len(r.output_ids) == 24 for r in requests)
    assert "play" in smollm2_q4.tokenizer.decode(requests[0].output_ids)  # "...loved to play with her toys"
    assert_nothing_leaked(engine)


@pytest.mark.slow
def test_prefix_hit_and_preemption_on_the_pool_of_codes(smollm2) -> None:
    """A shared system prompt is reused from encoded blocks with the output of a cold run; a pool
    too small for two requests preempts one, which recomputes and loses nothing."""
    system = "You are a careful assistant. Answer in one short sentence, plainly, and never make up facts. " * 2
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    cold = LLMEngine(smollm2, EngineConfig(num_blocks=64, prefix_cache=False), quantized("int8", "int8"))
    expected = [cold.generate([system + p], params)[0].output_ids for p in PROMPTS[:2]]
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=64), quantized("int8", "int8"))
    first = engine.add_request("first", system + PROMPTS[0], params)
    drain(engine, [first])
    second = engine.add_request("second", system + PROMPTS[1], params)
    drain(engine, [second])
    assert second.cached_tokens >= 32 and [first.output_ids, second.output_ids] == expected
    assert_nothing_leaked(engine)

    small = LLMEngine(smollm2, EngineConfig(num_blocks=8, block_size=8, max_tokens_per_step=64), quantized("int8", "int8"))
    long = SamplingParams(max_new_tokens=30, ignore_eos=True)
    requests = [small.add_request(f"p{i}", PROMPTS[i], long) for i in range(2)]
    drain(small, requests)
    assert small.scheduler.num_preemptions > 0
    for request, prompt in zip(requests, PROMPTS[:2]):
        assert request.output_ids == cold.generate([prompt], long)[0].output_ids
    assert_nothing_leaked(small)


def test_a_failed_step_frees_blocks_and_slots(smollm2, monkeypatch) -> None:
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=32), quantized("int4", "int4"))
    requests = [engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=4)) for i, p in enumerate(PROMPTS[:2])]
    engine.step()
    monkeypatch.setattr(engine.runner, "run", lambda rows: (_ for _ in ()).throw(RuntimeError("simulated")))
    outputs = engine.step()
    assert {o.finish_reason for o in outputs} == {"error"} and not engine.has_unfinished()
    assert all(r.status is RequestStatus.FINISHED for r in requests)
    assert_nothing_leaked(engine)


def test_options_the_pool_cannot_honour_are_refused(smollm2) -> None:
    with pytest.raises(ValueError, match="per-sequence: use --kv-cache paged"):
        LLMEngine(smollm2, EngineConfig(num_blocks=8), CacheConfig("window", window=64))
    with pytest.raises(ValueError, match="drop residual"):
        LLMEngine(smollm2, EngineConfig(num_blocks=8), CacheConfig("quantized", k_dtype="int8", residual=8))
    with pytest.raises(ValueError, match="does not hold the 68 fp32 staging slots"):
        LLMEngine(smollm2, EngineConfig(kv_budget_mb=4), quantized("int4", "int4"))
    with pytest.raises(ValueError, match=r"KV option k_dtype \(--kv-dtype-k\) applies to the quantized"):
        CacheConfig("paged", k_dtype="int8")


def test_generate_batch_runs_on_the_llm_cache_format(smollm2) -> None:
    from kvgen import LLM

    llm = LLM(smollm2.model, _Checkpoint(smollm2), cache=quantized("int8", "int4"))
    results = llm.generate_batch(PROMPTS[:2], SamplingParams(max_new_tokens=4))
    assert isinstance(llm._batch.engine.storage, QuantizedPagedStorage)
    assert all(len(r.token_ids) == 4 for r in results)


class _Checkpoint:
    """The pieces of a loaded checkpoint LLM() keeps, taken from an already loaded LLM."""

    def __init__(self, llm) -> None:
        self.tokenizer, self.config, self.path, self.weights = llm.tokenizer, llm.config, llm.path, llm.weights

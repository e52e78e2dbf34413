"""Speculation inside GenerationStream and Session: same tokens, the cache invariant kept when a
verified run is cut short, everything freed on abandon, bad setups refused before any work.

These run a tiny random-weight model (fast, exact equality still holds); the real-model evidence is
test_greedy_equality.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgen import LLM, CacheConfig, SamplingParams, SpeculativeConfig
from kvgen.generate import Generator
from kvgen.speculative.config import MAX_DRAFT_TOKENS
from tests.support.tiny_gguf import write_tiny_gguf

REPETITIVE = "abcdabcdabcdabcdabcd"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return LLM.load(write_tiny_gguf(tmp_path_factory.mktemp("spec") / "tiny.gguf"), progress=False, weights="fp32")


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return LLM.load(write_tiny_gguf(tmp_path_factory.mktemp("spec") / "draft.gguf", seed=5), progress=False, weights="fp32")


def test_session_turns_match_plain_and_keep_the_cache_invariant(tiny: LLM):
    params = SamplingParams(max_new_tokens=7, ignore_eos=True)  # 7: budget ends inside a verified run
    config = SpeculativeConfig("lookup", num_draft_tokens=6)
    plain, fast = tiny.session(), tiny.session()
    conversation = REPETITIVE
    for _ in range(2):
        reference = plain.stream(conversation, params)
        expected = [chunk.token_id for chunk in reference]
        stream = fast.stream(conversation, params, speculative=config)
        assert [chunk.token_id for chunk in stream] == expected
        ids = tiny.tokenizer.encode(conversation) + stream.result.token_ids
        assert stream.cache.seq_len == len(ids) - 1  # every generated token but the last, nothing more
        assert fast.cached_ids == ids[:-1] == plain.cached_ids
        assert stream.result.speculative.accepted_tokens > 0
        conversation = tiny.tokenizer.decode(ids) + "abcd"


def test_draft_model_sampling_is_reproducible_with_a_seed(tiny: LLM, tiny_draft: LLM):
    params = SamplingParams(max_new_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
    # A fixed length: the adaptive controller would pause after the first rejected probe.
    config = SpeculativeConfig("draft", draft_model=tiny_draft, adaptive=False)
    first = tiny.generate(REPETITIVE, params, speculative=config)
    assert first.token_ids == tiny.generate(REPETITIVE, params, speculative=config).token_ids
    assert first.speculative.verify_steps > 0


def _self_draft_stream_read_partly(generator: Generator):
    """A self-drafting stream whose consumer has read 6 chunks and stopped (not yet closed)."""
    stream = generator.stream(REPETITIVE, SamplingParams(max_new_tokens=40, ignore_eos=True),
                              speculative=SpeculativeConfig("self", draft_layers=1))  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 5:
            break
    return stream


def test_abandoned_stream_frees_the_paged_blocks(tiny: LLM):
    generator = Generator(tiny.model, tiny.tokenizer, cache=CacheConfig(kind="paged", block_size=4, budget_mb=4))
    stream = _self_draft_stream_read_partly(generator)
    proposer = stream._proposer
    assert proposer.target is stream.cache and proposer.own is None  # fp32 paged blocks: the draft shares them
    stream._iterator.close()  # what a consumer that drops the stream triggers
    pool = generator.caches.paged_storage.pool
    assert pool.num_free == pool.num_blocks


def test_abandoned_stream_frees_the_self_drafts_own_cache(tiny: LLM):
    generator = Generator(tiny.model, tiny.tokenizer, cache=CacheConfig(kind="window", window=16, extra=8))
    stream = _self_draft_stream_read_partly(generator)
    proposer = stream._proposer
    assert proposer.target is None  # a window cache drops positions on write: the draft keeps its own cache
    assert proposer.own.cache.seq_len > 0
    stream._iterator.close()
    assert proposer.own.cache.seq_len == 0


def test_bad_speculative_setups_fail_before_any_work(tiny: LLM):
    with pytest.raises(ValueError, match="unknown speculative method"):
        SpeculativeConfig("medusa")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs draft_model"):
        SpeculativeConfig("draft")
    with pytest.raises(ValueError, match="min_draft_tokens <= num_draft_tokens"):
        SpeculativeConfig("lookup", num_draft_tokens=0)
    with pytest.raises(ValueError, match="L must be in"):
        tiny.stream("hi", speculative=SpeculativeConfig("self", draft_layers=2))  # the tiny model has 2 layers
    narrow = Generator(tiny.model, tiny.tokenizer, cache=CacheConfig(kind="window", window=16, extra=2))
    with pytest.raises(ValueError, match=f"set extra >= {MAX_DRAFT_TOKENS}"):
        narrow.stream("hi", speculative=SpeculativeConfig("lookup"))
    session = tiny.session()
    with pytest.raises(ValueError, match="hidden size"):  # the shipped head is for SmolLM2 (576 wide)
        session.stream("hi", speculative=SpeculativeConfig("eagle"))
    assert session.cached_ids == [] and session.cache.seq_len == 0


def test_a_draft_model_with_another_vocabulary_is_refused(tiny: LLM, smollm2_q4: LLM):
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        tiny.stream("hi", speculative=SpeculativeConfig("draft", draft_model=smollm2_q4))

"""DecoderLM.forward_batch on the real SmolLM2 and Gemma 3: a ragged batch (prefill and decode rows
mixed, each over its own cache of any kind) gives the same last-token logits as each sequence run
alone from scratch, and a failure half-way commits nothing."""

from __future__ import annotations

import pytest
import torch

from kvgen.kv import CacheFullError, CacheSpec, ContiguousCache, PagedCache, PagedStorage
from kvgen.kv.block_pool import BlockPool
from kvgen.kv.paged_batch import PagedBatchView
from kvgen.kv.window import WindowedCache
from tests.support.models import PROMPTS

# Tokens already in the cache before the batched step, and tokens the step appends (1 = a decode row).
SPLITS = [(0, 11), (7, 1), (0, 3), (12, 1), (5, 9), (0, 1), (20, 1), (3, 17)]


def sequences(llm, count: int = len(SPLITS)) -> list[list[int]]:
    text = " ".join(PROMPTS) * 2
    ids = llm.tokenizer.encode(text)
    return [ids[i * 3 : i * 3 + cached + new] for i, (cached, new) in enumerate(SPLITS[:count])]


def assert_same_logits(batched: torch.Tensor, reference: torch.Tensor, what: str = "") -> None:
    """Equal up to fp32 reordering: 1e-5 of the logit scale (Gemma's logits reach ~40, where a
    different matmul shape moves the last bits by ~2e-4), and the same greedy token."""
    difference = (batched - reference).abs().max().item()
    assert difference <= 1e-5 * reference.abs().max().item(), f"{what}: max |diff| {difference}"
    assert batched.argmax() == reference.argmax(), what


@torch.inference_mode()
def alone(llm, ids: list[int]) -> torch.Tensor:
    """Reference: the whole sequence from scratch in one contiguous cache -> last logits [V]."""
    cache = ContiguousCache(CacheSpec.for_model(llm.config), capacity=len(ids))
    return llm.model(torch.tensor([ids]), cache)[0, -1]


def make_cache(llm, kind: str, storage: PagedStorage | None):
    spec = CacheSpec.for_model(llm.config)
    if kind == "paged":
        return PagedCache(storage)
    if kind == "window":
        return WindowedCache.for_model(llm.config, torch.float32, 16)
    return ContiguousCache(spec, capacity=8, max_capacity=4096)


@torch.inference_mode()
def run_batch(llm, seqs: list[list[int]], kinds: list[str]) -> tuple[torch.Tensor, list]:
    storage = PagedStorage(CacheSpec.for_model(llm.config), BlockPool(64, 4))
    caches = [make_cache(llm, kind, storage) for kind in kinds]
    for cache, ids, (cached, _) in zip(caches, seqs, SPLITS):
        if cached:  # earlier history, prefilled alone
            llm.model(torch.tensor([ids[:cached]]), cache)
    logits = llm.model.forward_batch([ids[cached:] for ids, (cached, _) in zip(seqs, SPLITS)], caches)
    return logits, caches


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_ragged_batch_equals_each_sequence_alone(name, request) -> None:
    llm = request.getfixturevalue(name)
    seqs = sequences(llm)
    kinds = ["contiguous", "paged", "window", "paged", "contiguous", "window", "paged", "contiguous"]
    logits, caches = run_batch(llm, seqs, kinds)
    assert logits.shape == (len(seqs), llm.config.vocab_size)
    for row, ids in enumerate(seqs):
        assert_same_logits(logits[row], alone(llm, ids), f"row {row}")
        assert caches[row].seq_len == len(ids)
        caches[row].check_invariants()


@torch.inference_mode()
def test_decode_steps_after_a_batched_prefill_match(smollm2) -> None:
    """Three batched greedy decode steps == the same tokens appended to each sequence alone."""
    seqs = sequences(smollm2, 4)
    logits, caches = run_batch(smollm2, seqs, ["paged"] * 4)
    for _ in range(3):
        tokens = logits.argmax(-1).tolist()
        for ids, token in zip(seqs, tokens):
            ids.append(token)
        logits = smollm2.model.forward_batch([[t] for t in tokens], caches)
    for row, ids in enumerate(seqs):
        assert_same_logits(logits[row], alone(smollm2, ids))


@torch.inference_mode()
def test_a_failure_mid_forward_commits_nothing(smollm2) -> None:
    spec = CacheSpec.for_model(smollm2.config)
    storage = PagedStorage(spec, BlockPool(5, 4))  # 20 positions in all
    ids = smollm2.tokenizer.encode(" ".join(PROMPTS))
    seqs = [ids[:11], ids[20:36], ids[40:50]]
    roomy = ContiguousCache(spec, capacity=64)
    first, starved = PagedCache(storage), PagedCache(storage)
    smollm2.model(torch.tensor([seqs[1][:8]]), starved)  # takes 2 blocks
    smollm2.model(torch.tensor([seqs[0][:8]]), first)  # takes 2 more; 1 block left
    rows, caches = [seqs[2][:10], seqs[0][8:11], seqs[1][8:16]], [roomy, first, starved]
    with pytest.raises(CacheFullError):
        smollm2.model.forward_batch(rows, caches)  # `first` needs its 3rd block, `starved` 2 more: none left
    assert [c.seq_len for c in caches] == [0, 8, 8]
    for cache in caches:
        cache.check_invariants()
    starved.release()  # room again: the same batch now succeeds and matches the reference
    smollm2.model(torch.tensor([seqs[1][:8]]), starved)
    first.truncate(8)  # the failed pass reserved a 3rd block for `first`; truncating gives it back
    assert len(first.blocks) == 2
    logits = smollm2.model.forward_batch(rows[:2], caches[:2])
    assert_same_logits(logits[0], alone(smollm2, seqs[2][:10]))
    assert_same_logits(logits[1], alone(smollm2, seqs[0][:11]))
    storage.pool.check_invariants()


def test_bad_batches_are_rejected_before_any_work(smollm2) -> None:
    cache = ContiguousCache(CacheSpec.for_model(smollm2.config), capacity=8)
    with pytest.raises(ValueError, match="one cache per row"):
        smollm2.model.forward_batch([[1], [2]], [cache])
    with pytest.raises(ValueError, match="same cache for two rows"):
        smollm2.model.forward_batch([[1], [2]], [cache, cache])
    with pytest.raises(ValueError, match="at least one token"):
        smollm2.model.forward_batch([[1], []], [cache, ContiguousCache(cache.spec, capacity=8)])
    assert cache.seq_len == 0


@pytest.mark.slow
@torch.inference_mode()
def test_gemma3_sliding_window_rows_past_the_window(gemma3) -> None:
    """Rows longer than Gemma 3's window (and a windowed cache that has dropped old positions) in
    one batch with a short row: per-row windowed masks over different key starts."""
    window = gemma3.config.sliding_window
    ids = gemma3.tokenizer.encode(" ".join(PROMPTS) * 200)
    long_ids, short_ids = ids[: 2 * window + 40], ids[5:30]
    dropping = WindowedCache.for_model(gemma3.config, torch.float32, 64)
    gemma3.model(torch.tensor([long_ids[: 2 * window + 20]]), dropping)
    assert max(dropping.visible_start(i) for i in range(gemma3.config.num_layers)) > 0
    full = ContiguousCache(CacheSpec.for_model(gemma3.config), capacity=64, max_capacity=4096)
    gemma3.model(torch.tensor([long_ids[: window + 10]]), full)
    rows = [long_ids[2 * window + 20 :], long_ids[window + 10 : window + 13], short_ids]
    logits = gemma3.model.forward_batch(rows, [dropping, full, ContiguousCache(full.spec, capacity=8, max_capacity=64)])
    for row, reference in enumerate([long_ids, long_ids[: window + 13], short_ids]):
        assert_same_logits(logits[row], alone(gemma3, reference))


@pytest.mark.slow
@torch.inference_mode()
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_decode_rows_attend_over_paged_blocks_in_place(name, request, monkeypatch) -> None:
    """One-token rows over one paged store skip the gather: the C kernel reads each row's blocks
    where they are (Gemma's sliding layers from the window's first position on). Same logits as
    each sequence alone, and the kernel really ran, once per layer."""
    llm = request.getfixturevalue(name)
    window = llm.config.sliding_window or 64
    ids = llm.tokenizer.encode(" ".join(PROMPTS) * 200)
    histories = [ids[: window + 20], ids[7:37], ids[3 : window + 5]]  # two rows past Gemma's window
    storage = PagedStorage(CacheSpec.for_model(llm.config), BlockPool(3 * (window + 64) // 16, 16))
    caches = [PagedCache(storage) for _ in histories]
    for cache, history in zip(caches, histories):
        llm.model(torch.tensor([history[:-1]]), cache)
    calls = []
    original = PagedBatchView.attend_in_place
    monkeypatch.setattr(PagedBatchView, "attend_in_place", lambda self, *a: calls.append(1) or original(self, *a))
    logits = llm.model.forward_batch([h[-1:] for h in histories], caches)
    assert len(calls) == llm.config.num_layers
    for row, history in enumerate(histories):
        assert_same_logits(logits[row], alone(llm, history), f"row {row}")


@pytest.mark.parametrize("weights", ["fp32", "q4"])
@torch.inference_mode()
def test_with_hidden_returns_each_rows_features_and_the_same_logits(smollm2, smollm2_q4, weights) -> None:
    """What an EAGLE head in the engine drafts from: the last block's output at each row's kept
    tokens, as `hidden_states` gives it for the sequence alone (bit for bit where the C rows step
    runs: the 4-bit weights), and the logits forward_batch gives without it."""
    llm = smollm2_q4 if weights == "q4" else smollm2
    text = llm.tokenizer.encode(" ".join(PROMPTS))
    seqs = [text[i * 5 : i * 5 + 9] for i in range(3)]
    storage = PagedStorage(CacheSpec.for_model(llm.config), BlockPool(64, 4))

    def batch(with_hidden: bool):
        caches = [PagedCache(storage) for _ in seqs]
        for cache, ids in zip(caches, seqs):
            llm.model(torch.tensor([ids[:6]]), cache)
        out = llm.model.forward_batch([ids[6:] for ids in seqs], caches, [3, 1, 2], with_hidden=with_hidden)
        for cache in caches:
            cache.truncate(0)
        return out

    logits, hidden = batch(with_hidden=True)
    assert torch.equal(logits, batch(with_hidden=False))
    expected = []
    for ids, kept in zip(seqs, [3, 1, 2]):
        cache = PagedCache(storage)
        llm.model(torch.tensor([ids[:6]]), cache)
        expected.append(llm.model.hidden_states(torch.tensor([ids[6:]]), cache)[0, -kept:])
        cache.truncate(0)
    expected = torch.cat(expected)
    assert hidden.shape == (6, llm.config.hidden_size)
    if weights == "q4":
        assert torch.equal(hidden, expected)
    else:  # the torch path pads the batch: fp32 reordering only
        torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)

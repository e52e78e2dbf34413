"""TieredCache: placement by LRU, promotion, prefetch, cold-file errors, cleanup, SmolLM2 end to end."""

from __future__ import annotations

import torch
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvgen import LLM, CacheConfig, SamplingParams
from kvgen.generate import Generator
from kvgen.kv import CacheSpec, ContiguousCache
from kvgen.kv.codecs import value_codec
from kvgen.kv.tier_store import ColdBlockError, pack, unpack_layer
from kvgen.kv.tiered import TieredCache
from tests.support.kv import random_kv

SPEC = CacheSpec(num_layers=3, num_kv_heads=2, head_dim=4)


def kv(seed: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_kv(SPEC, seed, length)


def append(caches: list, seed: int, length: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    keys, values = kv(seed, length)
    out = []
    for cache in caches:
        out.append([tuple(t.clone() for t in cache.update(layer, keys, values)) for layer in range(SPEC.num_layers)])
        cache.commit(length)
    return out


def test_blocks_move_down_the_tiers_newest_hot_and_come_back_up(tmp_path) -> None:
    cache = TieredCache(SPEC, block_size=4, hot_tokens=8, warm_tokens=4, warm_dtype="fp32", directory=tmp_path)
    plain = ContiguousCache(SPEC, capacity=64)
    append([cache, plain], 1, 18)  # 4 sealed blocks + 2 in the tail
    assert cache.tiers() == ["cold", "warm", "hot", "hot"]
    assert len(list(cache.directory.iterdir())) == 1 and cache.directory.parent == tmp_path
    got, want = append([cache, plain], 2, 3)  # the cold block is read (prefetched at commit) and verified
    for (k, v), (pk, pv) in zip(got, want):
        assert torch.equal(k, pk) and torch.equal(v, pv)
    assert cache.stats["cold_reads"] == SPEC.num_layers
    assert cache.tiers() == ["cold", "cold", "warm", "hot", "hot"]
    cache.truncate(9)  # two blocks dropped, block 2 becomes the tail: budget frees, old blocks move up
    assert cache.tiers() == ["hot", "hot"] and cache.stats["promotions"] == 2
    assert len(list(cache.directory.iterdir())) == 2  # promoted blocks keep their files (they never change)
    cache.check_invariants()
    cache.close()
    assert not any(tmp_path.iterdir())


def test_warm_int8_packing_rounds_exactly_as_the_int8_codec() -> None:
    keys, values = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 4, 16)
    packed = pack(keys, values, "int8")
    assert packed["k"].dtype == torch.int8
    k, v = unpack_layer({name: t[1] for name, t in packed.items()})
    assert torch.equal(k, value_codec("int8").round(keys[1])) and torch.equal(v, value_codec("int8").round(values[1]))


@pytest.mark.parametrize("damage", ["delete", "flip", "truncate"])
def test_a_damaged_cold_file_raises_a_clear_error_and_changes_nothing(tmp_path, damage: str) -> None:
    cache = TieredCache(SPEC, block_size=4, hot_tokens=0, warm_tokens=0, directory=tmp_path, prefetch_workers=1)
    append([cache], 1, 9)
    cache._drain()  # the prefetch at commit would otherwise have read the file before we damage it
    path = next(cache.directory.iterdir())
    if damage == "delete":
        path.unlink()
    elif damage == "flip":
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(path.read_bytes()[:-10])
    expected = {"delete": "was deleted", "flip": "fails its sha256 check", "truncate": "fails its sha256 check"}[damage]
    with pytest.raises(ColdBlockError, match=f"cold KV block .*{path.name}.*{expected}.*recompute the prompt"):
        append([cache], 2, 1)
    assert cache.seq_len == 9
    cache.release()
    assert not tmp_path.joinpath(cache.directory.name if cache.directory else "x").exists() and not any(tmp_path.iterdir())


def test_close_and_context_manager_remove_everything_created(tmp_path) -> None:
    with TieredCache(SPEC, block_size=2, hot_tokens=0, warm_tokens=2, directory=tmp_path) as cache:
        append([cache], 1, 11)
        twin = cache.fork()
        assert twin.directory != cache.directory and len(list(tmp_path.iterdir())) == 2
        twin.close()
        assert len(list(tmp_path.iterdir())) == 1  # the fork removed only its own directory
        append([cache], 2, 2)
        cache.check_invariants()
    assert not any(tmp_path.iterdir())
    abandoned = TieredCache(SPEC, block_size=2, hot_tokens=0, warm_tokens=0, directory=tmp_path)
    append([abandoned], 3, 5)
    del abandoned  # the finalizer removes what a forgotten cache created
    assert not any(tmp_path.iterdir())


def shift_marker(layer: int, keys: torch.Tensor, delta: int) -> torch.Tensor:
    """A stand-in for RoPE re-rotation that is easy to check: moving back d positions subtracts d."""
    return keys + delta


def read(cache: TieredCache | ContiguousCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's K, V as attention reads them now (an update of no new positions)."""
    return [tuple(t.clone() for t in cache.update(layer, *kv(0, 0))) for layer in range(SPEC.num_layers)]


def test_remove_range_rebuilds_later_blocks_in_their_tiers(tmp_path) -> None:
    cache = TieredCache(SPEC, block_size=4, hot_tokens=8, warm_tokens=4, warm_dtype="fp32", directory=tmp_path)
    plain = ContiguousCache(SPEC, capacity=64)
    append([cache, plain], 1, 18)
    assert cache.tiers() == ["cold", "warm", "hot", "hot"]
    old_file = next(cache.directory.iterdir())
    for c in (cache, plain):
        c.remove_range(6, 11, shift_marker)  # blocks 1..2 rebuilt in their tiers, block 0 kept, block 3 dropped
    assert cache.seq_len == 13 and cache.positions_removed == 5
    assert cache.tiers() == ["warm", "hot", "hot"]  # one block fewer: block 0 moves up a tier
    assert list(cache.directory.iterdir()) == [old_file]  # ... and keeps its file (it did not change)
    cache.check_invariants()
    for (k, v), (pk, pv) in zip(read(cache), read(plain)):
        assert torch.equal(k, pk) and torch.equal(v, pv)
    for c in (cache, plain):
        c.remove_range(1, 3, shift_marker)  # block 0 rebuilt too: its old file goes
    assert cache.tiers() == ["hot", "hot"] and not any(cache.directory.iterdir())
    cache.check_invariants()
    for (k, v), (pk, pv) in zip(append([cache], 2, 3)[0], append([plain], 2, 3)[0]):
        assert torch.equal(k, pk) and torch.equal(v, pv)
    cache.close()


@pytest.mark.parametrize("warm_dtype", ["fp16", "bf16", "int8"])
def test_remove_range_in_lossy_tiers_rounds_only_the_turned_keys_again(warm_dtype: str) -> None:
    cache = TieredCache(SPEC, block_size=4, hot_tokens=0, warm_tokens=8, warm_dtype=warm_dtype)
    append([cache], 1, 18)  # [cold, cold, warm, warm] + 2 in the tail
    reference = ContiguousCache(SPEC, capacity=64)
    for layer, (k, v) in enumerate(read(cache)):  # what the cache holds, as the exact reference
        reference.update(layer, k, v)
    reference.commit(18)
    for c in (cache, reference):
        c.remove_range(3, 9, shift_marker)
    cache.check_invariants()
    rounded = slice(0, 16 - 6)  # held packed before the move: values and unmoved keys pack to the same numbers
    for (k, v), (want_k, want_v) in zip(read(cache), read(reference)):
        assert torch.equal(v[:, :, rounded], want_v[:, :, rounded]) and torch.equal(k[:, :, :3], want_k[:, :, :3])
        for got, want in ((k, want_k), (v, want_v)):  # turned keys, and the old tail now sealed: one rounding
            one_rounding = {"fp16": want.abs() * 2**-11, "bf16": want.abs() * 2**-8,
                            "int8": want.abs().amax(-1, keepdim=True) / 254 * 1.002}[warm_dtype]  # fmt: skip
            assert ((got - want).abs() <= one_rounding + 1e-6).all()
    cache.close()


def test_a_damaged_cold_file_fails_remove_range_and_changes_nothing(tmp_path) -> None:
    cache = TieredCache(SPEC, block_size=4, hot_tokens=0, warm_tokens=0, directory=tmp_path, prefetch_workers=1)
    append([cache], 1, 14)  # three cold blocks
    before, files = read(cache), sorted(cache.directory.iterdir())
    cache._drain()
    files[2].write_bytes(files[2].read_bytes()[:-10])  # block 2: read after block 0 is rebuilt
    with pytest.raises(ColdBlockError, match="fails its sha256 check"):
        cache.remove_range(1, 2, shift_marker)
    assert cache.seq_len == 14 and cache.positions_removed == 0
    assert sorted(cache.directory.iterdir()) == files  # the new file written for block 0 is gone again
    files[2].unlink()  # (only the damaged block is unreadable; the rest reads as before)
    assert torch.equal(cache._block_fp32(0, cache._blocks[0])[0], torch.stack([k[0, :, :4] for k, _ in before]))
    cache.release()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown warm tier dtype 'int5'"):
        TieredCache(SPEC, warm_dtype="int5")
    with pytest.raises(ValueError, match="unknown warm tier dtype"):
        CacheConfig("tiered", warm_dtype="int5")


class TieredVersusContiguous(RuleBasedStateMachine):
    """Random appends, truncations, range removals, forks and releases over tiny budgets (every tier
    in use) with a lossless warm tier: every update returns exactly what a contiguous cache returns."""

    def __init__(self) -> None:
        super().__init__()
        make = TieredCache(SPEC, block_size=3, hot_tokens=3, warm_tokens=6, warm_dtype="fp32", prefetch_workers=1)
        self.pairs = [(make, ContiguousCache(SPEC, capacity=4, max_capacity=100))]
        self.seed = 0

    @rule(index=st.integers(0, 9), length=st.integers(1, 8))
    def append(self, index: int, length: int) -> None:
        tiered, plain = self.pairs[index % len(self.pairs)]
        if plain.seq_len + length > 60:
            return
        self.seed += 1
        got, want = append([tiered, plain], self.seed, length)
        for (k, v), (pk, pv) in zip(got, want):
            assert torch.equal(k, pk) and torch.equal(v, pv)

    @rule(index=st.integers(0, 9), keep=st.integers(0, 60))
    def truncate(self, index: int, keep: int) -> None:
        tiered, plain = self.pairs[index % len(self.pairs)]
        keep = min(keep, plain.seq_len)
        tiered.truncate(keep)
        plain.truncate(keep)

    @rule(index=st.integers(0, 9), start=st.integers(0, 60), length=st.integers(0, 10))
    def remove_range(self, index: int, start: int, length: int) -> None:
        tiered, plain = self.pairs[index % len(self.pairs)]
        start = min(start, plain.seq_len)
        end = min(start + length, plain.seq_len)
        tiered.remove_range(start, end, shift_marker)
        plain.remove_range(start, end, shift_marker)
        assert tiered.positions_removed == plain.positions_removed
        for (k, v), (pk, pv) in zip(read(tiered), read(plain)):
            assert torch.equal(k, pk) and torch.equal(v, pv)

    @rule(index=st.integers(0, 9))
    def fork(self, index: int) -> None:
        if len(self.pairs) < 3:
            tiered, plain = self.pairs[index % len(self.pairs)]
            self.pairs.append((tiered.fork(), plain.fork()))

    @rule(index=st.integers(0, 9))
    def release(self, index: int) -> None:
        tiered, plain = self.pairs[index % len(self.pairs)]
        tiered.release()
        plain.reset()
        assert tiered.directory is None

    @invariant()
    def consistent(self) -> None:
        for tiered, plain in self.pairs:
            tiered.check_invariants()
            assert tiered.seq_len == plain.seq_len

    def teardown(self) -> None:
        for tiered, _ in self.pairs:
            tiered.close()


TestTieredVersusContiguous = TieredVersusContiguous.TestCase
TestTieredVersusContiguous.settings = settings(max_examples=50, stateful_step_count=25, deadline=None)


@pytest.mark.slow
@pytest.mark.parametrize("warm_dtype", ["fp32", "fp16"])
def test_smollm2_tokens_equal_the_contiguous_cache(smollm2: LLM, tmp_path, warm_dtype: str) -> None:
    """Most of a 300-token prompt lives on disk and in the warm tier; greedy tokens equal the
    contiguous cache's (fp32 warm: exactly lossless; fp16: rounding small enough not to flip a token)."""
    config = CacheConfig("tiered", block_size=16, hot_tokens=64, warm_tokens=64, warm_dtype=warm_dtype)
    tiered = Generator(smollm2.model, smollm2.tokenizer, cache=config)
    ids = smollm2.tokenizer.encode("The history of the city begins with a small settlement on the river. " * 20)[:300]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    stream = tiered.stream(ids, params)
    for _ in stream:
        if stream.cache.seq_len > 0:
            tiers = stream.cache.tiers()
    assert tiers.count("cold") >= 10 and tiers.count("warm") == 4 and tiers.count("hot") == 4
    assert stream.result.token_ids == smollm2.generate(ids, params).token_ids
    assert stream.cache.directory is None  # the finished request deleted its files

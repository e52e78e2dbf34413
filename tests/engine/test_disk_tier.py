"""The prefix index's disk tier on the real SmolLM2 engine: evicted blocks come back from disk, a
new engine on the same directory starts warm, damaged or foreign files are skipped (and the output
is still exactly a cold run's), the budget holds, tenants never share, one engine per directory."""

from __future__ import annotations

import errno

import pytest

from kvgen import SamplingParams
from kvgen.engine import EngineConfig, LLMEngine
from kvgen.kv import disk_store
from kvgen.kv.block_file import SUFFIX, read_block_file, read_header, write_block_file
from tests.engine.test_engine import SYSTEM, alone, assert_nothing_leaked, drain
from tests.support.block_files import block_chain
from tests.support.models import PROMPTS

PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)
PROMPT = SYSTEM * 2 + PROMPTS[1]  # 9 full blocks of 16


def engine_on(llm, directory, **options) -> LLMEngine:
    return LLMEngine(llm, EngineConfig(num_blocks=options.pop("num_blocks", 64), kv_cache_dir=str(directory), **options))


def run(engine: LLMEngine, prompt: str, salt: str = ""):
    request = engine.add_request(f"r{engine.runner.num_forwards}-{salt}", prompt, PARAMS, salt=salt)
    drain(engine, [request])
    return request


@pytest.fixture(scope="module")
def cold(smollm2) -> list[int]:
    return alone(smollm2, PROMPT, PARAMS)


def test_evicted_blocks_come_back_from_disk(smollm2, tmp_path, cold) -> None:
    engine = engine_on(smollm2, tmp_path)
    first = run(engine, PROMPT)
    full_blocks = (len(first.prompt_ids) - 1) // 16
    engine.scheduler.prefix.clear()  # evicts every block: each goes to a file
    assert len(list(tmp_path.glob("*" + SUFFIX))) >= full_blocks
    assert engine.disk.store.stats.files_written == len(engine.disk.store.entries)
    before = engine.runner.num_tokens
    again = run(engine, PROMPT)
    assert again.output_ids == first.output_ids == cold
    assert again.cached_tokens == full_blocks * 16 and again.miss_reason == "hit"
    assert engine.disk.hits.disk_blocks == full_blocks and engine.disk.hits.restore_seconds > 0
    assert engine.runner.num_tokens - before == len(again.prompt_ids) + len(again.output_ids) - 1 - again.cached_tokens
    assert_nothing_leaked(engine)
    engine.close()


def test_a_restarted_engine_serves_the_prefix_from_disk(smollm2, tmp_path, cold) -> None:
    first = engine_on(smollm2, tmp_path)
    run(first, PROMPT)
    computed_cold = first.runner.num_tokens
    first.close()  # writes the RAM index, releases the directory
    restarted = engine_on(smollm2, tmp_path)
    with pytest.raises(ValueError, match=f"{tmp_path}.*in use by another kvgen engine"):
        engine_on(smollm2, tmp_path)
    warm = run(restarted, PROMPT)
    assert warm.output_ids == cold and warm.cached_tokens == (len(warm.prompt_ids) - 1) // 16 * 16 > 0
    assert restarted.runner.num_tokens == computed_cold - warm.cached_tokens
    tenant = run(restarted, PROMPT, salt="tenant-b")  # another namespace: nothing from disk
    assert tenant.cached_tokens == 0 and tenant.output_ids == cold
    assert restarted.disk.hits.disk_blocks == warm.cached_tokens // 16
    assert_nothing_leaked(restarted)
    restarted.close()


def test_damaged_and_foreign_files_are_skipped(smollm2, tmp_path, cold, caplog) -> None:
    writer = engine_on(smollm2, tmp_path)
    run(writer, PROMPT)
    writer.close()
    with caplog.at_level("WARNING", logger="kvgen.kv.disk"):
        other_format = engine_on(smollm2, tmp_path, block_size=8)  # every file is of another format
        assert other_format.disk.store.stats.mismatched_files == len(block_chain(tmp_path))
        assert run(other_format, PROMPT).output_ids == cold
        other_format.scheduler.prefix.clear()
        other_format.disk.store.close()  # leave its own bs8 files out of the next scan
        for path in tmp_path.glob("*" + SUFFIX):
            if read_header(path)["block_size"] == "8":
                path.unlink()

        files = block_chain(tmp_path)
        data = bytearray(files[2].read_bytes())
        data[-7] ^= 0x55  # block 2: a flipped payload byte
        files[2].write_bytes(bytes(data))
        files[4].write_bytes(files[4].read_bytes()[:-1000])  # block 4: truncated
        parts, _ = read_block_file(files[3], {})
        other_model = {**read_header(files[3]), "model": "0" * 64}
        write_block_file(files[3], parts, other_model)  # block 3: another model's
        engine = engine_on(smollm2, tmp_path)
        stats = engine.disk.store.stats
        assert stats.damaged_files == 1 and stats.mismatched_files == 1  # seen by the scan
        request = run(engine, PROMPT)
    assert request.output_ids == cold
    assert request.cached_tokens == 2 * 16  # blocks 0 and 1; block 2 failed its checksum
    assert stats.damaged_files == 2 and not files[2].exists() and not files[4].exists() and files[3].exists()
    assert "sha256" in caplog.text and "truncated" in caplog.text and "another model" in caplog.text
    assert_nothing_leaked(engine)
    engine.close()


@pytest.mark.slow
def test_the_disk_budget_holds(smollm2, tmp_path) -> None:
    budget_mb = 3.0  # four SmolLM2 fp32 blocks of 16 tokens (737 kB each)
    engine = engine_on(smollm2, tmp_path, num_blocks=12, kv_disk_budget_mb=budget_mb)
    for i, prompt in enumerate(PROMPTS[:3]):
        request = run(engine, f"{i} " + SYSTEM * 2 + prompt)  # a new path: evicts most of the last one
        assert request.output_ids == alone(smollm2, f"{i} " + SYSTEM * 2 + prompt, PARAMS)
        on_disk = sum(p.stat().st_size for p in tmp_path.glob("*" + SUFFIX))
        assert on_disk == engine.disk.store.bytes_used <= budget_mb * 2**20
    assert engine.disk.store.stats.files_evicted > 0
    assert_nothing_leaked(engine)
    engine.close()


def test_a_full_disk_drops_blocks_and_fails_nothing(smollm2, tmp_path, cold, monkeypatch, caplog) -> None:
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    engine = engine_on(smollm2, tmp_path)
    monkeypatch.setattr(disk_store, "write_block_file", full)  # what a full disk does to a write
    run(engine, PROMPT)
    with caplog.at_level("WARNING", logger="kvgen.kv.disk"):
        engine.scheduler.prefix.clear()
    assert engine.disk.store.stats.write_errors > 0 and "No space left" in caplog.text
    assert not list(tmp_path.glob("*" + SUFFIX)) and not list(tmp_path.glob("*.partial"))
    assert run(engine, PROMPT).output_ids == cold
    assert_nothing_leaked(engine)
    engine.close()


def test_unusable_settings_are_refused(smollm2, tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not writable"):
        engine_on(smollm2, tmp_path / "file" / "cache")
    with pytest.raises(ValueError, match="needs prefix_cache=True"):
        EngineConfig(kv_cache_dir=str(tmp_path), prefix_cache=False)
    with pytest.raises(ValueError, match="kv_disk_budget_mb must be positive"):
        EngineConfig(kv_cache_dir=str(tmp_path), kv_disk_budget_mb=0)


@pytest.mark.slow
def test_preempted_requests_come_back_from_disk(smollm2, tmp_path) -> None:
    """A preempted request's blocks stay indexed; when the pool evicts them they go to disk, and
    the request's readmission loads them instead of recomputing (the swap, through the tier)."""
    params = SamplingParams(max_new_tokens=20)
    engine = engine_on(smollm2, tmp_path, num_blocks=4, block_size=8, max_tokens_per_step=64)  # 32 slots
    requests = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(PROMPTS[:4])]
    drain(engine, requests)
    assert engine.scheduler.num_preemptions > 0 and engine.disk.hits.disk_blocks > 0
    for request, prompt in zip(requests, PROMPTS):
        assert request.output_ids == alone(smollm2, prompt, params), prompt
    assert_nothing_leaked(engine)
    engine.close()


@pytest.mark.slow
def test_a_pool_of_codes_restarts_from_disk_and_never_serves_another_format(smollm2, tmp_path) -> None:
    """int8 keys / int4 values: a restarted engine of that format reads its blocks back (codes and
    scales, byte for byte) with a cold run's output; an fp32 engine on the same directory skips them."""
    from kvgen import CacheConfig

    quantized = CacheConfig("quantized", k_dtype="int8", v_dtype="int4")
    first = LLMEngine(smollm2, EngineConfig(num_blocks=64, kv_cache_dir=str(tmp_path)), quantized)
    cold = run(first, PROMPT).output_ids
    first.close()
    restarted = LLMEngine(smollm2, EngineConfig(num_blocks=64, kv_cache_dir=str(tmp_path)), quantized)
    warm = run(restarted, PROMPT)
    assert warm.output_ids == cold and warm.cached_tokens == (len(warm.prompt_ids) - 1) // 16 * 16 > 0
    assert restarted.disk.hits.disk_blocks == warm.cached_tokens // 16
    restarted.storage.check_invariants()
    restarted.close()
    fp32 = engine_on(smollm2, tmp_path)
    assert fp32.disk.store.stats.mismatched_files > 0
    other = run(fp32, PROMPT)
    assert other.cached_tokens == 0
    fp32.close()

"""The engine (and generate_batch, the server) serving Mamba, Mamba-2 and T5, against transformers on
the same random weights and against each request run alone.

No Mamba, Mamba-2 or T5 checkpoint installs offline: these are small random-weight models that transformers
itself builds and saves (tests/support/tiny_hf.py).
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
import torch

from kvgen import LLM, CacheConfig, SamplingParams
from kvgen.engine import EngineConfig, LLMEngine, RequestStatus
from kvgen.speculative.config import SpeculativeConfig
from tests.server.live import live_server
from tests.support.models import PROMPTS
from tests.support.recurrent import assert_idle, random_ids, transformers_greedy
from tests.support.tiny_hf import save_tiny_mamba, save_tiny_mamba2, save_tiny_t5, tokenizer_folder

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_new_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory):
    return tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def mamba(tmp_path_factory: pytest.TempPathFactory, tokenizer_files) -> tuple[Any, LLM]:
    folder = tmp_path_factory.mktemp("mamba")
    model = save_tiny_mamba(folder, tokenizer_files)
    return model, LLM.load(folder, progress=False, weights="fp32")


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory: pytest.TempPathFactory, tokenizer_files) -> tuple[Any, LLM]:
    folder = tmp_path_factory.mktemp("mamba2")
    model = save_tiny_mamba2(folder, tokenizer_files)
    return model, LLM.load(folder, progress=False, weights="fp32")


@pytest.fixture(scope="module")
def t5(tmp_path_factory: pytest.TempPathFactory, tokenizer_files) -> tuple[Any, LLM]:
    folder = tmp_path_factory.mktemp("t5")
    model = save_tiny_t5(folder, tokenizer_files)
    return model, LLM.load(folder, progress=False, weights="fp32")


def t5_reference(model: Any, ids: list[int], count: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=count, min_new_tokens=count, do_sample=False)
    return out[0, 1:].tolist()  # after the decoder start token


def test_mamba_engine_rows_equal_transformers_and_each_row_alone(mamba: tuple[Any, LLM]) -> None:
    """Prompts of different lengths decode together, their prefills chunked beside other rows' decodes."""
    model, llm = mamba
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:4]] + [random_ids(90, 1)]
    engine = LLMEngine(llm, EngineConfig(max_tokens_per_step=24, block_size=8))
    requests = engine.generate(prompts, GREEDY)
    for ids, request in zip(prompts, requests):
        assert request.output_ids == transformers_greedy(model, ids, 32)
        assert request.output_ids == llm.generate(ids, GREEDY).token_ids  # the row alone
    assert_idle(engine)
    assert engine.scheduler.prefix.num_snapshots > 0  # block-boundary states were kept
    batch = llm.generate_batch(prompts, GREEDY)
    assert [r.token_ids for r in batch] == [r.output_ids for r in requests]


def test_mamba_prefix_cache_resumes_from_a_block_boundary_state(mamba: tuple[Any, LLM]) -> None:
    _, llm = mamba
    engine = LLMEngine(llm, EngineConfig(block_size=16))
    shared = random_ids(150, 2)
    first, second = shared + random_ids(20, 3), shared + random_ids(30, 4)
    first_output = engine.generate([first], GREEDY)[0].output_ids
    request = engine.add_request("second", second, GREEDY)
    other_salt = engine.add_request("salted", second, GREEDY, salt="tenant-b")
    while engine.has_unfinished():
        engine.step()
    assert request.cached_tokens == 144 and request.miss_reason == "hit"  # 150 // 16 blocks of the shared prefix
    assert other_salt.cached_tokens == 0 and other_salt.miss_reason == "no match"
    assert request.output_ids == other_salt.output_ids == llm.generate(second, GREEDY).token_ids  # == from scratch
    # States along `first`'s output were indexed too: a next turn that repeats it resumes inside it.
    follow_up = first + first_output[:20]
    again = engine.generate([follow_up], GREEDY)[0]
    assert again.cached_tokens == 176 and again.output_ids == llm.generate(follow_up, GREEDY).token_ids
    assert_idle(engine)
    # generate_batch keeps its engine (and so its prefix cache) across calls.
    llm.generate_batch([first], GREEDY)
    resumed = llm.generate_batch([second], GREEDY)[0]
    assert resumed.usage.cached_tokens > 0 and resumed.token_ids == request.output_ids


def test_mamba_admission_counts_states_and_cancel_frees_them(mamba: tuple[Any, LLM]) -> None:
    _, llm = mamba
    engine = LLMEngine(llm, EngineConfig(num_blocks=3, block_size=8, max_tokens_per_step=64))
    requests = [engine.add_request(f"r{i}", random_ids(20, 10 + i), GREEDY) for i in range(5)]
    most_running = 0
    engine.step()
    cancelled = engine.cancel("r0")
    assert cancelled is not None and cancelled.finish_reason == "cancelled"
    while engine.has_unfinished():
        most_running = max(most_running, len(engine.scheduler.running))
        engine.check_invariants()
        engine.step()
    assert most_running == 3  # one state each, the budget's 3 units (snapshots are evicted for them)
    for request in requests[1:]:
        assert request.status is RequestStatus.FINISHED and request.output_ids == llm.generate(request.prompt_ids, GREEDY).token_ids
    assert_idle(engine)


def test_mamba_served_on_completions(mamba: tuple[Any, LLM]) -> None:
    model, llm = mamba
    prompt = PROMPTS[1]
    expected = llm.tokenizer.decode(transformers_greedy(model, llm.tokenizer.encode(prompt), 12))
    with live_server(llm, EngineConfig(), max_tokens_limit=64) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0, n=2,
                                        extra_body={"ignore_eos": True})  # fmt: skip
        assert [c.text for c in out.choices] == [expected] * 2
        server.assert_no_leaks()  # every unit in use is a prefix snapshot


def test_mamba_engine_refuses_what_it_cannot_honour(mamba: tuple[Any, LLM], tmp_path) -> None:
    _, llm = mamba
    with pytest.raises(ValueError, match="kv_cache_dir"):
        LLMEngine(llm, EngineConfig(kv_cache_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="eviction"):
        LLMEngine(llm, EngineConfig(eviction="lfu"))
    with pytest.raises(ValueError, match="does not apply to mamba"):
        LLMEngine(llm, cache=CacheConfig(kind="quantized"))
    engine = LLMEngine(llm)
    with pytest.raises(ValueError, match="speculative method 'eagle' reads the target's features"):  # lookup runs (tests/speculative)
        engine.add_request("s", "hello", GREEDY, speculative=SpeculativeConfig(method="eagle"))
    assert not engine.has_unfinished()


def test_mamba2_engine_rows_equal_transformers_and_resume_from_a_block_boundary_state(mamba2: tuple[Any, LLM]) -> None:
    """Prompts of different lengths decode together (prefills chunked beside other rows' decodes);
    a later prompt sharing one's prefix resumes from the block-boundary state the first left."""
    model, llm = mamba2
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:3]] + [random_ids(90, 1)]
    engine = LLMEngine(llm, EngineConfig(max_tokens_per_step=24, block_size=8))
    requests = engine.generate(prompts, GREEDY)
    for ids, request in zip(prompts, requests):
        assert request.output_ids == transformers_greedy(model, ids, 32)
        assert request.output_ids == llm.generate(ids, GREEDY).token_ids  # the row alone
    second = prompts[-1][:85] + random_ids(10, 2)
    resumed = engine.generate([second], GREEDY)[0]
    assert resumed.cached_tokens == 80 and resumed.output_ids == llm.generate(second, GREEDY).token_ids  # 85 // 8 blocks
    assert_idle(engine)


def test_t5_engine_runs_the_encoder_once_per_distinct_input(t5: tuple[Any, LLM]) -> None:
    """8 requests over 2 inputs: 2 encoder passes, and every output is transformers'."""
    model, llm = t5
    inputs = [llm.tokenizer.encode(p) for p in ("Translate to German: the house is small.", "Summarize: a long story")]
    engine = LLMEngine(llm, EngineConfig(max_num_seqs=8))
    before = llm.model.encoder_runs
    requests = engine.generate([inputs[i % 2] for i in range(8)], GREEDY)
    assert llm.model.encoder_runs - before == 2
    expected = [t5_reference(model, ids, 32) for ids in inputs]
    for i, request in enumerate(requests):
        assert request.output_ids == expected[i % 2]
    salted = engine.add_request("salted", inputs[0], GREEDY, salt="tenant-b")
    while engine.has_unfinished():
        engine.step()
    assert llm.model.encoder_runs - before == 3 and salted.output_ids == expected[0]  # another salt: its own entry
    assert_idle(engine)
    assert all(entry.refs == 0 for entry in llm.model.encoder_cache._entries.values())


def test_t5_engine_rows_equal_transformers_budget_and_cancel(t5: tuple[Any, LLM]) -> None:
    model, llm = t5
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:4]] + [random_ids(40, 30)]  # 40: over a step's 16 tokens
    longest = max(len(p) for p in prompts)
    # Room for two of the longest requests at a time (prompt + 32 new + the start token, each).
    engine = LLMEngine(llm, EngineConfig(num_blocks=2 * (longest + 33), max_tokens_per_step=16))
    victim = engine.add_request("victim", prompts[0], GREEDY)
    engine.step()
    engine.cancel("victim")
    assert victim.cache is None and engine.scheduler.num_blocks_in_use() == 0
    requests = [engine.add_request(f"t{i}", p, GREEDY) for i, p in enumerate(prompts)]
    most_running = 0
    while engine.has_unfinished():
        most_running = max(most_running, len(engine.scheduler.running))
        engine.check_invariants()  # reservations within the budget
        engine.step()
    assert 2 <= most_running < len(prompts)
    for ids, request in zip(prompts, requests):
        assert request.output_ids == t5_reference(model, ids, 32)
    assert_idle(engine)
    with pytest.raises(ValueError, match="more than the engine's whole budget"):
        engine.add_request("huge", prompts[0], SamplingParams(max_new_tokens=10_000))
    with pytest.raises(ValueError, match="speculative decoding is not supported for t5"):  # its decoder's cache keeps no positions
        engine.add_request("drafts", prompts[0], GREEDY, speculative=SpeculativeConfig(method="lookup"))
    batch = llm.generate_batch(prompts, GREEDY)
    assert [r.token_ids for r in batch] == [r.output_ids for r in requests]


def test_t5_served_on_completions_and_chat(t5: tuple[Any, LLM]) -> None:
    model, llm = t5
    prompt = "Translate to French: the cat sleeps."
    expected = llm.tokenizer.decode(t5_reference(model, llm.tokenizer.encode(prompt), 16))
    with live_server(llm, EngineConfig(), max_tokens_limit=64) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        before = llm.model.encoder_runs
        out = client.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0, n=3,
                                        extra_body={"ignore_eos": True})  # fmt: skip
        assert [c.text for c in out.choices] == [expected] * 3
        assert llm.model.encoder_runs - before == 1  # the n choices share one encoder entry
        messages = [{"role": "user", "content": "Say something."}]
        rendered = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)
        chat = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})  # fmt: skip
        assert chat.choices[0].message.content == llm.tokenizer.decode(t5_reference(model, rendered, 8))
        server.assert_no_leaks()


def test_t5_samples_of_one_input_share_its_encoder_entry(t5: tuple[Any, LLM]) -> None:
    """LLM.generate with n > 1: one encoder pass, each sample as if run alone (seed + i)."""
    model, llm = t5
    ids = llm.tokenizer.encode("Question: why is the sky blue?")
    before = llm.model.encoder_runs
    greedy = llm.generate_n(ids, SamplingParams(max_new_tokens=16, ignore_eos=True, n=3))
    assert llm.model.encoder_runs - before == 1
    assert [r.token_ids for r in greedy] == [t5_reference(model, ids, 16)] * 3
    sampled = llm.generate_n(ids, SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=5, n=2))
    alone = [llm.generate(ids, SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=5 + i)) for i in range(2)]
    assert [r.token_ids for r in sampled] == [r.token_ids for r in alone]
    assert all(entry.refs == 0 for entry in llm.model.encoder_cache._entries.values())


def test_t5_batched_decode_rows_equal_each_row_alone(t5: tuple[Any, LLM]) -> None:
    """Rows with different input and decoded lengths, plus a row starting a new input, in one call."""
    _, llm = t5
    model = llm.model
    inputs, decoded = [random_ids(12, 20), random_ids(5, 21), random_ids(30, 22)], [random_ids(9, 23), [], random_ids(3, 24)]
    with torch.inference_mode():
        batched = [model.new_state_cache() for _ in inputs]
        for ids, more, cache in zip(inputs, decoded, batched):
            model(torch.tensor([ids]), cache)
            for token in more:
                model(torch.tensor([[token]]), cache)
        singles = [cache.fork() for cache in batched]
        fresh, fresh_alone = model.new_state_cache(), model.new_state_cache()
        alone = [model(torch.tensor([[7 + r]]), cache)[0, -1] for r, cache in enumerate(singles)]
        alone.append(model(torch.tensor([inputs[0]]), fresh_alone)[0, -1])
        together = model.forward_batch([[7], [8], [9], inputs[0]], batched + [fresh])  # [4, V]
    assert (together - torch.stack(alone)).abs().max().item() < 1e-5
    assert [c.seq_len for c in batched + [fresh]] == [c.seq_len for c in singles + [fresh_alone]]
    for cache in batched + singles + [fresh, fresh_alone]:
        cache.release()


@pytest.mark.parametrize("family", ["mamba", "mamba2", "t5"])
def test_a_failed_forward_frees_its_requests(family: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward that raises (injected once) fails the rows of that step and frees all they held;
    the engine goes on."""
    _, llm = request.getfixturevalue(family)
    engine = LLMEngine(llm, EngineConfig())
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    for i, ids in enumerate(prompts):
        engine.add_request(f"f{i}", ids, GREEDY)
    engine.step()  # prompts computed, first tokens sampled

    def broken(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("injected failure")

    monkeypatch.setattr(llm.model, "forward_batch", broken)
    outputs = engine.step()
    monkeypatch.undo()
    assert [(o.finish_reason, o.error) for o in outputs] == [("error", "RuntimeError: injected failure")] * 2
    assert not engine.has_unfinished()
    assert_idle(engine)
    if family == "t5":
        assert all(entry.refs == 0 for entry in llm.model.encoder_cache._entries.values())
    assert engine.generate([prompts[0]], GREEDY)[0].output_ids == llm.generate(prompts[0], GREEDY).token_ids

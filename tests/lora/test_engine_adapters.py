"""Adapters in the batching engine: mixed-adapter batches equal each request alone, the adapter
keys the prefix cache, and bad input (unknown name, mismatched or damaged file, unload in use)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvgen import SamplingParams
from kvgen.engine import EngineConfig, LLMEngine, RequestStatus
from kvgen.lora import AdapterError, UnknownAdapterError
from tests.conftest import load_llm
from tests.engine.test_engine import SYSTEM, assert_nothing_leaked, drain
from tests.support.models import PROMPTS

PARAMS = SamplingParams(max_new_tokens=8)


@pytest.mark.slow
@torch.inference_mode()
def test_16_concurrent_requests_over_4_adapters_and_the_base_equal_each_alone(smollm2_q4_adapters) -> None:
    """On 4-bit weights: base and adapter decodes share the C rows step, each row with its own
    adapter's deltas; every request's greedy tokens equal its run alone in the engine."""
    llm, adapters = smollm2_q4_adapters
    names = [None, *adapters]  # 5 choices over 16 requests
    prompts = [PROMPTS[i % 4] + " " * (i // 4) for i in range(16)]
    params = [dataclasses.replace(PARAMS, max_new_tokens=12, ignore_eos=True, adapter=names[i % 5]) for i in range(16)]
    engine = LLMEngine(llm, EngineConfig(kv_budget_mb=128, max_num_seqs=16, prefix_cache=False))
    alone = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        request = engine.add_request(f"alone{i}", prompt, p)
        drain(engine, [request])
        alone.append(request.output_ids)
    requests, waiting = [], list(enumerate(zip(prompts, params)))
    while waiting or any(r.status is not RequestStatus.FINISHED for r in requests):
        if waiting:  # one arrival per step: its prefill overlaps the others' decodes
            i, (prompt, p) = waiting.pop(0)
            requests.append(engine.add_request(f"r{i}", prompt, p))
        engine.step()
    different = [i for i, (r, a) in enumerate(zip(requests, alone)) if r.output_ids != a]
    assert not different, f"requests {different} differ from their run alone"
    assert len({tuple(a) for a in alone[:5]}) == 5  # the adapters change the text: not a vacuous check
    assert_nothing_leaked(engine)
    assert all(info["in_use"] == 0 for info in llm.adapters.info().values())


def test_the_adapter_keys_the_prefix_cache(smollm2_adapters) -> None:
    llm, _ = smollm2_adapters
    engine = LLMEngine(llm, EngineConfig(num_blocks=64))
    first = engine.add_request("first", SYSTEM + PROMPTS[0], dataclasses.replace(PARAMS, adapter="qv-r4"))
    drain(engine, [first])
    other = engine.add_request("other", SYSTEM + PROMPTS[1], dataclasses.replace(PARAMS, adapter="k-r2"))
    base = engine.add_request("base", SYSTEM + PROMPTS[1], PARAMS)
    same = engine.add_request("same", SYSTEM + PROMPTS[1], dataclasses.replace(PARAMS, adapter="qv-r4"))
    drain(engine, [other, base, same])
    assert other.cached_tokens == 0 and base.cached_tokens == 0
    assert same.cached_tokens >= 16  # blocks computed under the same adapter are shared
    want = llm.generate(SYSTEM + PROMPTS[1], dataclasses.replace(PARAMS, adapter="qv-r4")).token_ids
    assert same.output_ids == want
    assert_nothing_leaked(engine)


def test_unknown_adapter_is_refused_and_changes_nothing(smollm2_adapters) -> None:
    llm, _ = smollm2_adapters
    engine = LLMEngine(llm, EngineConfig(num_blocks=64))
    with pytest.raises(UnknownAdapterError, match="'nope' is not loaded"):
        engine.add_request("x", PROMPTS[0], dataclasses.replace(PARAMS, adapter="nope"))
    with pytest.raises(UnknownAdapterError, match="'nope' is not loaded"):
        llm.generate(PROMPTS[0], dataclasses.replace(PARAMS, adapter="nope"))
    assert not engine.has_unfinished()
    assert_nothing_leaked(engine)


def test_unloading_an_adapter_in_use_waits_for_its_requests(smollm2_adapters) -> None:
    llm, adapters = smollm2_adapters
    llm.load_adapter("temp", adapters["qv-r4"].path)
    want = llm.generate(PROMPTS[0], dataclasses.replace(PARAMS, adapter="temp")).token_ids
    engine = LLMEngine(llm, EngineConfig(num_blocks=64))
    running = engine.add_request("running", PROMPTS[0], dataclasses.replace(PARAMS, adapter="temp"))
    engine.step()
    assert llm.unload_adapter("temp") is False  # deferred: the running request keeps it
    with pytest.raises(UnknownAdapterError):  # new requests for it are refused at once
        engine.add_request("late", PROMPTS[1], dataclasses.replace(PARAMS, adapter="temp"))
    drain(engine, [running])
    assert running.output_ids == want  # nothing lost
    assert "temp" not in llm.adapters.info()  # gone with its last request
    assert_nothing_leaked(engine)


def test_prompt_lookup_under_an_adapter_gives_the_adapters_greedy_tokens(smollm2_q4_adapters) -> None:
    """The verify runs under the request's adapter, so drafts from the text (prompt lookup) keep the
    adapter's greedy tokens exactly, alone and in the engine; the layer-skip draft and EAGLE, which
    draft from the base model's own layers and features, are refused by name and change nothing."""
    from kvgen.speculative.config import SpeculativeConfig

    llm, _ = smollm2_q4_adapters
    params = SamplingParams(max_new_tokens=48, ignore_eos=True, adapter="all-r8-rs")
    for prompt in PROMPTS[:2]:  # drafts accepted where the adapter's text and the base model's part
        plain = llm.generate(prompt, params).token_ids
        assert plain != llm.generate(prompt, dataclasses.replace(params, adapter=None)).token_ids  # the adapter's own text
        drafted = llm.generate(prompt, params, speculative=SpeculativeConfig("lookup"))
        assert drafted.token_ids == plain
        assert drafted.speculative.accepted_tokens > 0  # drafts were verified under the adapter and kept
    engine = LLMEngine(llm, EngineConfig(num_blocks=64))
    request = engine.add_request("s", prompt, params, speculative=SpeculativeConfig("lookup"))
    drain(engine, [request])
    assert request.output_ids == plain and engine.speculative_totals.accepted_tokens > 0
    for method in ("self", "eagle"):
        with pytest.raises(ValueError, match=f"speculative method '{method}' drafts from the base model"):
            llm.generate(prompt, params, speculative=SpeculativeConfig(method))
        with pytest.raises(ValueError, match=f"speculative method '{method}' drafts from the base model"):
            engine.add_request(method, prompt, params, speculative=SpeculativeConfig(method))
    assert not engine.has_unfinished()
    assert_nothing_leaked(engine)
    assert all(info["in_use"] == 0 for info in llm.adapters.info().values())


def test_a_session_recomputes_its_cache_when_the_adapter_changes(smollm2_adapters) -> None:
    llm, _ = smollm2_adapters
    session = llm.session()
    try:
        session.stream(PROMPTS[0], dataclasses.replace(PARAMS, adapter="qv-r4")).result  # noqa: B018
        stream = session.stream(PROMPTS[0] + " and", dataclasses.replace(PARAMS, adapter="k-r2"))
        ids = list(stream)
        assert stream.result.usage.cached_tokens == 0
        want = llm.generate(PROMPTS[0] + " and", dataclasses.replace(PARAMS, adapter="k-r2")).token_ids
        assert [c.token_id for c in ids] == want
    finally:
        session.close()


def test_mismatched_and_damaged_adapters_are_refused(smollm2_adapters, lora_dir) -> None:
    llm, adapters = smollm2_adapters
    gemma = load_llm("gemma3-270m")
    with pytest.raises(AdapterError, match="made for another base model"):
        gemma.load_adapter("smol", adapters["all-r8-rs"].path)
    assert gemma.adapters.names() == []
    damaged = lora_dir / "damaged"
    damaged.mkdir(exist_ok=True)
    source = adapters["qv-r4"].path
    (damaged / "adapter_config.json").write_text((source / "adapter_config.json").read_text())
    (damaged / "adapter_model.safetensors").write_bytes((source / "adapter_model.safetensors").read_bytes()[:-100])
    with pytest.raises(AdapterError, match="not a readable safetensors file"):
        llm.load_adapter("damaged", damaged)
    with pytest.raises(AdapterError, match="no LoRA adapter at"):
        llm.load_adapter("missing", lora_dir / "nothing-here")
    with pytest.raises(AdapterError, match="loaded already"):
        llm.load_adapter("qv-r4", source)
    assert "damaged" not in llm.adapters.names() and "missing" not in llm.adapters.names()

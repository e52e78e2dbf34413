"""Speculative decoding on models that keep their own state (Mamba, Mamba-2, LFM2, Granite 4.0-H,
Nemotron-H, Falcon-H1): a verify pass keeps the state after each of its positions, and the
rejected drafts roll back to the last accepted one, so the greedy tokens are plain decoding's.

No checkpoint of these families installs offline: the models are small random-weight ones that
transformers builds (tests/support/tiny_hf.py). Random models rarely repeat their prompt, so
besides prompt lookup the drafts come from a drafter that knows plain decoding's tokens and spoils
one in every few (`SpoiledOracle`): every step then has accepted drafts and most a rejected one.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from kvgen import LLM, SamplingParams
from kvgen.engine import EngineConfig, LLMEngine
from kvgen.speculative.config import SpeculativeConfig
from tests.support.models import model_path
from tests.support.recurrent import SpoiledOracle, assert_a_chain_is_one_token_steps, assert_idle, random_ids
from tests.support.tiny_hf import (save_tiny_falcon_h1, save_tiny_granite_hybrid, save_tiny_lfm2, save_tiny_mamba, save_tiny_mamba2, save_tiny_nemotron_h,
                                   tokenizer_folder)  # fmt: skip

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
MODELS: dict[str, Callable[..., Any]] = {
    "mamba": save_tiny_mamba, "mamba2": save_tiny_mamba2, "lfm2": save_tiny_lfm2, "granite": lambda folder, tokenizer: save_tiny_granite_hybrid(folder, tokenizer, experts=0),
    "nemotron-h": save_tiny_nemotron_h, "nemotron-3-nano": lambda folder, tokenizer: save_tiny_nemotron_h(folder, tokenizer, experts=4),
    "falcon-h1": save_tiny_falcon_h1,
}  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LLM]:
    """Each family with int8 projections (the C decode step), and LFM2 with fp32 (the torch path)."""
    tokenizer = tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))
    loaded = {}
    for name, save in MODELS.items():
        folder = tmp_path_factory.mktemp(name)
        save(folder, tokenizer)
        loaded[name] = LLM.load(folder, progress=False, weights="int8")
        if name == "lfm2":
            loaded["lfm2-fp32"] = LLM.load(folder, progress=False, weights="fp32")
    return loaded


@pytest.mark.parametrize("name", [name for name in MODELS if name != "mamba"])
def test_a_prompt_leaves_the_states_decoding_it_token_by_token_leaves(name: str, models: dict[str, LLM]) -> None:
    """What a verify (or a prefix hit, or a session) resumes from: after a 20-token prompt, ten
    tokens as one chunk leave every layer's conv and recurrent state bit for bit as ten one-token
    decode steps do (the prompt's conv and gated norm run the decode step's arithmetic in C, and a
    hybrid's MLPs and mixtures its rows). Mamba (1) is left out: its prompt runs its dt and x
    projections in torch, 1e-9 from the step's."""
    llm, ids = models[name], random_ids(30, 3)
    with torch.inference_mode():
        stepped, chunked = llm.model.new_state_cache(), llm.model.new_state_cache()
        for cache in (stepped, chunked):
            llm.model(torch.tensor([ids[:20]]), cache)
        for token in ids[20:]:
            llm.model(torch.tensor([[token]]), stepped)
        llm.model(torch.tensor([ids[20:]]), chunked)
    for layer in range(stepped.spec.num_layers):
        assert torch.equal(stepped.conv_state(layer), chunked.conv_state(layer)), layer
        assert torch.equal(stepped.recurrent_state(layer), chunked.recurrent_state(layer)), layer


@pytest.mark.parametrize("name", MODELS)
def test_a_verify_runs_as_a_chain_of_one_token_steps(name: str, models: dict[str, LLM]) -> None:
    """Seven drafts and the last id verified in one C pass give, at every position, the logits and
    states of one-token decode steps, bit for bit: Mamba (1) included, whose prompts' torch
    projections are 1e-9 from the step's."""
    assert_a_chain_is_one_token_steps(models[name], random_ids(20, 3), random_ids(8, 4))


@pytest.mark.parametrize("name", [*MODELS, "lfm2-fp32"])
def test_drafts_accepted_and_rejected_give_plain_greedy_tokens(name: str, models: dict[str, LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    llm = models[name]
    prompt = random_ids(30, 3)
    plain = llm.generate(prompt, GREEDY).token_ids
    oracle = SpoiledOracle(prompt + plain)
    monkeypatch.setattr(SpeculativeConfig, "build_proposer", lambda self, generator: oracle)
    result = llm.generate(prompt, GREEDY, speculative=SpeculativeConfig("lookup", num_draft_tokens=4, adaptive=False))
    stats = result.speculative
    assert result.token_ids == plain
    assert stats.verify_steps >= 8 and 0 < stats.accepted_tokens < stats.proposed_tokens, stats  # rollbacks happened


@pytest.mark.parametrize("name", ["lfm2", "falcon-h1"])
def test_prompt_lookup_gives_plain_greedy_tokens(name: str, models: dict[str, LLM]) -> None:
    """Lookup's own drafts, on a prompt of a phrase said three times (these two models repeat
    parts of it, so some drafts are accepted)."""
    llm = models[name]
    prompt = random_ids(12, 3) * 3
    result = llm.generate(prompt, GREEDY, speculative=SpeculativeConfig("lookup"))
    assert result.token_ids == llm.generate(prompt, GREEDY).token_ids
    assert result.speculative.accepted_tokens > 0 or result.speculative.probe_accepted_tokens > 0


def test_a_session_keeps_its_checkpoints_through_speculative_turns(models: dict[str, LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    """A verify's per-position states neither become checkpoints nor evict them; the checkpoints a
    one-token step would take inside a verified run are taken from them once the run is settled:
    after a turn of 150 tokens decoded speculatively the session's cache holds plain decoding's
    checkpoints, bit for bit, and its next turn resumes from one and decodes what a plain session does."""
    llm = models["granite"]
    prompt, more = random_ids(20, 4), random_ids(5, 5)
    turn, follow = SamplingParams(max_new_tokens=150, ignore_eos=True), SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = llm.session()
    plain_tokens = run(plain, prompt, turn)
    monkeypatch.setattr(SpeculativeConfig, "build_proposer", lambda self, generator: SpoiledOracle(prompt + plain_tokens))
    session = llm.session()
    assert run(session, prompt, turn, SpeculativeConfig("lookup", adaptive=False)) == plain_tokens
    assert session.last_result.speculative.verify_steps > 10
    assert session.cache.checkpoints == plain.cache.checkpoints == [0, 64, 128]
    for length in (64, 128):
        for ours, theirs in zip(session.cache._checkpoints[length], plain.cache._checkpoints[length]):
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    conversation = prompt + plain_tokens + more
    assert run(session, conversation, follow) == run(plain, conversation, follow)
    assert session.last_result.usage.cached_tokens == plain.last_result.usage.cached_tokens > 64


def run(session: Any, ids: list[int], params: SamplingParams, speculative: SpeculativeConfig | None = None) -> list[int]:
    stream = session.stream(ids, params, speculative=speculative)
    for _ in stream:
        pass
    session.last_result = stream.result
    return stream.result.token_ids


@pytest.mark.parametrize("name", ["mamba", "lfm2", "granite", "nemotron-3-nano"])
def test_the_engine_verifies_drafts_beside_other_requests(name: str, models: dict[str, LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    """Four requests decode together in the engine, each verifying drafts that are accepted and
    rejected in the same steps as the others' (one of them a plain request): each gives the tokens
    it gives alone without drafts. Two stop at a token that an accepted draft went past; the engine
    holds nothing of them once they end."""
    llm = models[name]
    prompts = [random_ids(12 + 5 * i, 20 + i) for i in range(4)]
    unstopped = SamplingParams(max_new_tokens=30, ignore_eos=True)
    truths = [prompt + llm.generate(prompt, unstopped).token_ids for prompt in prompts]
    stops = (truths[0][len(prompts[0]) + 13], truths[1][len(prompts[1]) + 17])
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, stop_token_ids=stops)
    plain = [llm.generate(prompt, params).token_ids for prompt in prompts]
    assert len(plain[0]) <= 14 and len(plain[1]) <= 18  # the stops cut them short
    monkeypatch.setattr(SpeculativeConfig, "build_proposer", lambda self, generator: SpoiledOracle(*truths))
    engine = LLMEngine(llm, EngineConfig(max_tokens_per_step=32, block_size=8))
    speculative = SpeculativeConfig("lookup", num_draft_tokens=4, adaptive=False)
    requests = [engine.add_request(f"r{i}", prompt, params, speculative=None if i == 3 else speculative) for i, prompt in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    assert [request.output_ids for request in requests] == plain
    totals = engine.speculative_totals
    assert totals.verify_steps >= 8 and 0 < totals.accepted_tokens < totals.proposed_tokens, totals
    assert_idle(engine)


def test_a_verify_that_fails_frees_its_requests(models: dict[str, LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose verify fails inside the C step (after some layers wrote their states) fails
    its requests and frees all they held, the states the verify kept included; the engine goes on,
    and the same speculative request then gives plain decoding's tokens."""
    llm, prompt = models["granite"], random_ids(16, 40)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = llm.generate(prompt, params).token_ids
    monkeypatch.setattr(SpeculativeConfig, "build_proposer", lambda self, generator: SpoiledOracle(prompt + plain))
    speculative = SpeculativeConfig("lookup", num_draft_tokens=4, adaptive=False)
    engine = LLMEngine(llm, EngineConfig(max_tokens_per_step=32, block_size=8))
    request = engine.add_request("broken", prompt, params, speculative=speculative)
    engine.step()  # the prompt, and its first token
    step = llm.model._c_step()
    step_rows = step.step_rows

    def fails_after_writing(h: torch.Tensor, caches: list, slots: list, counts: list) -> None:
        step_rows(h, caches, slots, counts)  # every layer's states written and committed, keep_positions on
        raise RuntimeError("injected failure")

    with monkeypatch.context() as patch:
        patch.setattr(step, "step_rows", fails_after_writing)
        outputs = engine.step()
    assert [(o.finish_reason, o.error) for o in outputs] == [("error", "RuntimeError: injected failure")]
    assert request.cache is None and not engine.has_unfinished()
    assert_idle(engine)
    again = engine.add_request("again", prompt, params, speculative=speculative)
    while engine.has_unfinished():
        engine.step()
    assert again.output_ids == plain and engine.speculative_totals.accepted_tokens > 0


def test_methods_that_read_the_targets_cache_or_features_are_refused(models: dict[str, LLM]) -> None:
    llm, prompt = models["lfm2"], random_ids(8, 3)
    for method in ("self", "eagle"):
        with pytest.raises(ValueError, match=f"speculative method '{method}' reads the target's"):
            llm.generate(prompt, GREEDY, speculative=SpeculativeConfig(method))
    with pytest.raises(ValueError, match="draft with a model that keeps a KV cache"):
        llm.generate(prompt, GREEDY, speculative=SpeculativeConfig("draft", draft_model=models["mamba2"]))
    smollm2 = LLM.load(model_path("smollm2"), progress=False)  # a KV-cache draft sharing the tiny models' vocabulary
    result = llm.generate(prompt, GREEDY, speculative=SpeculativeConfig("draft", draft_model=smollm2))
    assert result.token_ids == llm.generate(prompt, GREEDY).token_ids

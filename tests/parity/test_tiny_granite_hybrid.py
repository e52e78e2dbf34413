"""Granite 4.0-H (Mamba-2 and attention layers) against transformers' GraniteMoeHybridForCausalLM on
the same weights: logits, greedy tokens, sessions over its hybrid cache, the engine; and Bamba, the
same stack without Granite's scalars, against BambaForCausalLM.

No Granite 4.0-H checkpoint installs offline: these are small random-weight models that transformers
itself builds and saves (tests/support/tiny_hf.py): Mamba-2 layers around one attention layer, a
mixture of 4 experts beside the shared MLP (and, as Granite-4.0-H-Micro, the shared MLP alone),
Granite's scalars away from 1, NoPE attention (and, as the config allows, RoPE); Bamba's with RoPE
over half of each head.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgen import LLM, SamplingParams
from kvgen.engine import EngineConfig, LLMEngine
from kvgen.speculative.config import SpeculativeConfig
from tests.support.models import PROMPTS, model_path
from tests.support.recurrent import (assert_logits_follow_transformers, assert_engine_tokens_equal_each_request_alone,
                                     assert_prefill_is_chunk_invariant, assert_c_rows_equal_each_row_alone, assert_c_step_follows_torch,
                                     assert_session_resumes_from_a_checkpoint, random_ids,
                                     transformers_greedy)  # fmt: skip
from tests.support.tiny_gguf import write_granite_hybrid_gguf
from tests.support.tiny_hf import save_tiny_bamba, save_tiny_granite_hybrid, tokenizer_folder

pytestmark = pytest.mark.slow
TOLERANCE = 1e-3
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
VARIANTS = {"experts-nope": (4, False), "dense-nope": (0, False), "experts-rope": (4, True)}
MODELS = [*sorted(VARIANTS), "bamba"]


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, LLM]]:
    tokenizer = tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))
    built = {}
    for name, (experts, rope) in VARIANTS.items():
        folder = tmp_path_factory.mktemp(name)
        model = save_tiny_granite_hybrid(folder, tokenizer, experts=experts, rope=rope)
        built[name] = model, LLM.load(folder, progress=False, weights="fp32")
    folder = tmp_path_factory.mktemp("bamba")
    built["bamba"] = save_tiny_bamba(folder, tokenizer), LLM.load(folder, progress=False, weights="fp32")
    return built


@pytest.mark.parametrize("name", MODELS)
def test_prefill_and_decode_logits_match(name: str, hybrids: dict) -> None:
    """Every position of a 70-token prefill (five Mamba-2 chunks, split at checkpoints every 24) and
    6 decode steps against transformers' forward over the same tokens."""
    model, llm = hybrids[name]
    assert_logits_follow_transformers(model, llm, 70, 24, TOLERANCE)


@pytest.mark.parametrize("name", ["experts-nope", "dense-nope"])
def test_gguf_loads_the_same_model(name: str, hybrids: dict, tmp_path: Path) -> None:
    """An all-F32 `granitehybrid` file as llama.cpp's converter writes it (KV heads per layer, 0 for
    a Mamba layer; the shared MLP as ffn_*_shexp or ffn_*; Mamba-2's tensors; no RoPE): the same
    model, up to what the file stores as float32 or not at all (the Mamba chunk, the context)."""
    model, llm = hybrids[name]
    from_gguf = LLM.load(write_granite_hybrid_gguf(tmp_path / "model.gguf", model, model_path("smollm2")), progress=False,
                         weights="fp32")  # fmt: skip
    ours, theirs = from_gguf.config, llm.config
    assert (ours.layer_types, ours.rope) == (theirs.layer_types, theirs.rope)
    assert math.isclose(ours.decoder.query_pre_attn_scalar, theirs.decoder.query_pre_attn_scalar, rel_tol=1e-6)
    same = {"rms_norm_eps": theirs.rms_norm_eps}
    assert dataclasses.replace(ours.mixer, **same, chunk_size=theirs.mixer.chunk_size) == theirs.mixer
    assert dataclasses.replace(ours.decoder, **same, max_position_embeddings=theirs.max_position_embeddings,
                               query_pre_attn_scalar=theirs.decoder.query_pre_attn_scalar) == theirs.decoder  # fmt: skip
    prompt = random_ids(40, 9)
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0]
        actual = from_gguf.model(torch.tensor([prompt]), from_gguf.generator.new_cache(0), logits_to_keep=len(prompt))[0]
    assert (actual - expected).abs().max().item() < TOLERANCE


def test_greedy_tokens_match_transformers_generate(hybrids: dict) -> None:
    model, llm = hybrids["experts-nope"]
    for prompt in PROMPTS[:2]:
        ids = llm.tokenizer.encode(prompt)
        assert llm.generate(ids, GREEDY).token_ids == transformers_greedy(model, ids, GREEDY.max_new_tokens)


def test_session_resumes_both_kinds_of_layer_from_a_checkpoint(hybrids: dict) -> None:
    """The Mamba layers resume from the checkpoint's state, the attention layers from their keys cut
    back to the same length."""
    _, llm = hybrids["experts-nope"]
    assert_session_resumes_from_a_checkpoint(llm, GREEDY, random_ids(150, 3), random_ids(20, 4), random_ids(30, 5))


def test_quantized_weights_stay_near_fp32(hybrids: dict) -> None:
    _, llm = hybrids["experts-nope"]
    int8 = LLM.load(llm.path, progress=False, weights="int8")
    prompt = random_ids(60, 6)
    with torch.inference_mode():
        actual = int8.model(torch.tensor([prompt]), int8.generator.new_cache(0), logits_to_keep=len(prompt))[0]
        expected = llm.model(torch.tensor([prompt]), llm.generator.new_cache(0), logits_to_keep=len(prompt))[0]
    assert (actual - expected).abs().max().item() < 0.1
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean().item() > 0.9


@pytest.mark.parametrize("name", MODELS)
def test_c_decode_step_follows_the_torch_step(name: str, hybrids: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 projections decode layer by layer in C (models/hybrid_decode.py: the Mamba-2 step, the
    blocks' MLP / mixture, attention through the cache): the torch step over the same linears gives
    the same logits up to the order of float sums, and the same greedy tokens."""
    _, llm = hybrids[name]
    # the prompt's attention blocks run in C too: a mixture's router flipped a near tie at one
    # position of this prompt (2.3e-3); every other position and every decode step within 2e-7
    prompt_tolerance = 1e-2 if hybrids[name][1].config.decoder.num_experts else 1e-4
    assert_c_step_follows_torch(LLM.load(llm.path, progress=False, weights="int8"), random_ids(20, 10), random_ids(16, 11), monkeypatch,
                                prompt_tolerance)  # fmt: skip


@pytest.mark.parametrize("name", ["experts-rope", "bamba"])
def test_prefill_gives_the_same_bits_however_the_prompt_is_split(name: str, hybrids: dict) -> None:
    """int8 projections: the attention layers' prompt rows run as decodes of their tokens, the Mamba-2
    scan takes its steps' softplus in C, the rest is row-invariant: a prompt's logits do not depend
    on how it is split."""
    _, llm = hybrids[name]
    assert_prefill_is_chunk_invariant(LLM.load(llm.path, progress=False, weights="int8"), random_ids(70, 31),
                                      [[66, 4], [31, 39], [1, 69], [17, 17, 36]])  # fmt: skip


@pytest.mark.parametrize("name", ["experts-rope", "bamba"])  # a mixture's rows; a dense MLP's, RoPE over half of each head
def test_c_rows_of_several_sequences_equal_each_alone(name: str, hybrids: dict) -> None:
    """The engine's one-token rows of three sequences of different lengths go through each layer
    together in C (int8 projections: the Mamba-2 step and the MLP over all rows, attention over each
    row's own keys): logits, states, keys and values bit for bit as each row's token alone; and the
    engine, whose steps mix such rows with chunks of prompts, decodes what each request does alone."""
    _, llm = hybrids[name]
    int8 = LLM.load(llm.path, progress=False, weights="int8")
    assert_c_rows_equal_each_row_alone(int8, [random_ids(n, 20 + n) for n in (9, 30, 17)], random_ids(3, 12))
    assert_engine_tokens_equal_each_request_alone(int8, GREEDY)


def test_engine_rows_equal_transformers_and_a_cancel_frees_its_reservation(hybrids: dict) -> None:
    """Prompts of different lengths run together (prefills chunked at 24 tokens beside decodes), each
    with its own state and keys; a reservation counts the state and every position's keys."""
    model, llm = hybrids["experts-nope"]
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:3]] + [random_ids(60, 7)]
    engine = LLMEngine(llm, EngineConfig(max_tokens_per_step=24, block_size=8))
    requests = engine.generate(prompts, GREEDY)
    for ids, request in zip(prompts, requests):
        assert request.output_ids == transformers_greedy(model, ids, GREEDY.max_new_tokens)
    assert engine.scheduler.num_blocks_in_use() == engine.scheduler.prefix.num_units  # only the prefix cache holds anything
    first = engine.add_request("a", prompts[0], GREEDY)
    engine.add_request("b", prompts[1], GREEDY)
    engine.step()
    assert engine.scheduler.num_blocks_in_use() > 0
    assert engine.cancel("b") is not None
    while engine.has_unfinished():
        engine.check_invariants()
        engine.step()
    assert first.output_ids == requests[0].output_ids
    assert engine.scheduler.num_blocks_in_use() == engine.scheduler.prefix.num_units and not engine.scheduler.running


def test_engine_prefix_cache_resumes_the_states_and_the_keys(hybrids: dict) -> None:
    """A prompt sharing 52 tokens with an earlier request's resumes from the snapshot at the last
    block boundary inside them (the Mamba layers' states and the attention layers' keys of the
    blocks before it, RoPE turning them) and decodes transformers' tokens; the prefix cache's blocks
    and snapshots are what the engine's budget counts once the requests end."""
    model, llm = hybrids["experts-rope"]
    shared = random_ids(52, 60)
    second = shared + random_ids(9, 62)
    engine = LLMEngine(llm, EngineConfig(max_tokens_per_step=24, block_size=8))
    engine.generate([shared + random_ids(6, 61)], GREEDY)
    (request,) = engine.generate([second], GREEDY)
    assert request.cached_tokens == 48 and request.miss_reason == "hit"
    assert request.output_ids == transformers_greedy(model, second, GREEDY.max_new_tokens)
    engine.check_invariants()
    assert engine.scheduler.num_blocks_in_use() == engine.scheduler.prefix.num_units > 0


def test_paths_the_hybrid_does_not_run_refuse_clearly(hybrids: dict) -> None:
    _, llm = hybrids["dense-nope"]
    with pytest.raises(ValueError, match="speculative method 'self' reads the target's KV cache"):  # lookup runs: tests/speculative
        llm.generate("hello", SamplingParams(max_new_tokens=2), speculative=SpeculativeConfig(method="self"))
    cache = llm.model.new_state_cache()
    with torch.inference_mode():
        llm.model(torch.tensor([random_ids(10, 8)]), cache)
    with pytest.raises(ValueError, match="checkpoint"):
        cache.truncate(5)  # its Mamba layers' state is held only at checkpoints
    assert cache.seq_len == cache.kv.seq_len == 10

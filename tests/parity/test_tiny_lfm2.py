"""LFM2 (gated short convolutions and attention layers) against transformers' Lfm2ForCausalLM on the
same weights: logits, greedy tokens, the C decode step and rows, sessions over its hybrid cache, the
engine and its prefix cache, and GGUF; LFM2-MoE against Lfm2MoeForCausalLM.

No LFM2 checkpoint installs offline: these are small random-weight models that transformers itself
builds and saves (tests/support/tiny_hf.py): three short-conv layers (biased) around two attention
layers with per-head q/k norms and RoPE; LFM2-MoE's with a mixture of 4 experts in its last three
layers (sigmoid scores, a choice bias, weights scaled by 1.5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from kvgen import LLM, SamplingParams
from kvgen.errors import ModelLoadError, UnsupportedModelError
from kvgen.loading.lfm2 import feed_forward_width, lfm2_config
from kvgen.loading.hf import config_from_hf
from tests.support.models import PROMPTS, model_path
from tests.support.recurrent import (assert_logits_follow_transformers, assert_engine_tokens_equal_each_request_alone,
                                     assert_engine_and_prefix_hit_follow_transformers, assert_prefill_is_chunk_invariant,
                                     assert_c_rows_equal_each_row_alone, assert_c_step_follows_torch,
                                     assert_session_resumes_from_a_checkpoint, random_ids,
                                     transformers_greedy)  # fmt: skip
from tests.support.tiny_gguf import write_lfm2_gguf
from tests.support.tiny_hf import save_tiny_lfm2, save_tiny_lfm2_moe, tokenizer_folder

pytestmark = pytest.mark.slow
TOLERANCE = 1e-3
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


MODELS = ["lfm2", "lfm2-moe"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, LLM, LLM]]:
    tokenizer = tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))
    models = {}
    for name, save in (("lfm2", save_tiny_lfm2), ("lfm2-moe", save_tiny_lfm2_moe)):
        folder = tmp_path_factory.mktemp(name)
        model = save(folder, tokenizer)
        models[name] = model, LLM.load(folder, progress=False, weights="fp32"), LLM.load(folder, progress=False, weights="int8")
    return models


@pytest.fixture(scope="module")
def lfm2(built: dict) -> tuple[Any, LLM, LLM]:
    return built["lfm2"]


@pytest.mark.parametrize("name", MODELS)
def test_prefill_and_decode_logits_match(name: str, built: dict) -> None:
    """Every position of a 40-token prefill (split at checkpoints every 16) and 6 decode steps
    against transformers' forward over the same tokens."""
    model, llm, _ = built[name]
    assert_logits_follow_transformers(model, llm, 40, 16, TOLERANCE)


def test_greedy_tokens_match_transformers_generate(lfm2: tuple) -> None:
    model, llm, _ = lfm2
    for prompt in PROMPTS[:2]:
        ids = llm.tokenizer.encode(prompt)
        assert llm.generate(ids, GREEDY).token_ids == transformers_greedy(model, ids, GREEDY.max_new_tokens)


@pytest.mark.parametrize("name", MODELS)
def test_c_decode_step_follows_the_torch_step(name: str, built: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 projections decode layer by layer in C (the short conv as kernels/mamba_step.c's
    kvgen_short_conv_step, attention, the SwiGLU and the mixture as the transformer blocks'): the
    torch step over the same linears gives the same logits up to the order of float sums, and the
    same tokens."""
    _, _, int8 = built[name]
    assert_c_step_follows_torch(int8, random_ids(20, 10), random_ids(16, 11), monkeypatch)


@pytest.mark.parametrize("name", MODELS)
def test_c_rows_of_several_sequences_equal_each_alone(name: str, built: dict) -> None:
    """The engine's one-token rows of three sequences go through each layer together in C: logits,
    conv windows, keys and values bit for bit as each row alone; the engine decodes what each
    request does alone."""
    _, _, int8 = built[name]
    assert_c_rows_equal_each_row_alone(int8, [random_ids(n, 20 + n) for n in (9, 30, 17)], random_ids(3, 12))
    assert_engine_tokens_equal_each_request_alone(int8, GREEDY)


@pytest.mark.parametrize("name", MODELS)
def test_prefill_gives_the_same_bits_however_the_prompt_is_split(name: str, built: dict) -> None:
    """With quantized projections the attention layers' prompt rows run as decodes of their tokens
    (HybridStep.prompt_block), and the rest is row-invariant, so the engine's chunking of a prompt
    does not move its logits."""
    _, _, int8 = built[name]
    assert_prefill_is_chunk_invariant(int8, random_ids(70, 31), [[66, 4], [31, 39], [1, 69], [17, 17, 36]])


def test_a_prompt_longer_than_one_rows_call(lfm2: tuple) -> None:
    """A prompt past MAX_ROWS (512) positions runs its attention rows in several C calls over one
    buffer reserved for all of them: its last positions stay near the fp32 model's (measured 0.026,
    as int8 weights do anywhere; a buffer grown between the calls, losing the first call's keys,
    moved them by 0.67), and split across the calls' boundary they are the same bits."""
    _, llm, int8 = lfm2
    ids = random_ids(600, 41)
    with torch.inference_mode():
        quantized = int8.model(torch.tensor([ids]), int8.model.new_state_cache(), logits_to_keep=100)[0]
        exact = llm.model(torch.tensor([ids]), llm.model.new_state_cache(), logits_to_keep=100)[0]
    assert (quantized - exact).abs().max().item() < 0.1
    assert_prefill_is_chunk_invariant(int8, ids, [[520, 80], [300, 300]])


def test_session_resumes_from_a_checkpoint(lfm2: tuple) -> None:
    _, llm, _ = lfm2
    assert_session_resumes_from_a_checkpoint(llm, GREEDY, random_ids(150, 3), random_ids(20, 4), random_ids(30, 5))


def test_engine_rows_and_prefix_cache_match_transformers(lfm2: tuple) -> None:
    """Prompts of different lengths run together (prefills chunked beside decodes); a prompt sharing
    52 tokens with an earlier one resumes at the last block boundary inside them (conv windows and
    keys restored) and decodes transformers' tokens; the prefix cache's units are all the budget
    holds once the requests end."""
    model, llm, _ = lfm2
    assert_engine_and_prefix_hit_follow_transformers(model, llm, GREEDY, PROMPTS[:2])


@pytest.mark.parametrize("name", MODELS)
def test_gguf_loads_the_same_model(name: str, built: dict, tmp_path: Path) -> None:
    """An all-F32 `lfm2` (`lfm2moe`) file as llama.cpp's converter writes it: the same config and
    transformers' logits; a Q8_0 file, its blocks kept (int8), decodes in C and stays near them."""
    model, llm, _ = built[name]
    from_gguf = LLM.load(write_lfm2_gguf(tmp_path / "f32.gguf", model, model_path("smollm2")), progress=False, weights="fp32")
    ours, theirs = from_gguf.config, llm.config
    assert (ours.layer_types, ours.mixer, ours.architecture) == (theirs.layer_types, theirs.mixer, "lfm2")
    assert ours.decoder.intermediate_size == theirs.decoder.intermediate_size
    moe = ("num_experts", "experts_per_token", "expert_intermediate_size", "moe_layers", "expert_scoring", "routed_scaling_factor")
    assert [getattr(ours.decoder, key) for key in moe] == [getattr(theirs.decoder, key) for key in moe]
    prompt = random_ids(40, 9)
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0]
        actual = from_gguf.model(torch.tensor([prompt]), from_gguf.generator.new_cache(0), logits_to_keep=len(prompt))[0]
        assert (actual - expected).abs().max().item() < TOLERANCE
        q8 = LLM.load(write_lfm2_gguf(tmp_path / "q8.gguf", model, model_path("smollm2"), gguf.GGMLQuantizationType.Q8_0),
                      progress=False, weights="int8")  # fmt: skip
        quantized = q8.model(torch.tensor([prompt]), q8.generator.new_cache(0), logits_to_keep=len(prompt))[0]
    assert q8.model._c_step() is not None
    assert (quantized - expected).abs().max().item() < 0.1  # measured 0.022 (logits' std 0.3)
    assert (quantized.argmax(-1) == expected.argmax(-1)).float().mean().item() > 0.9


def test_config_reads_transformers_widths_and_refuses_unknown_layers(lfm2: tuple) -> None:
    """The SwiGLU's width as transformers' Lfm2MLP computes it (LFM2-1.2B's numbers), layer kinds from
    layer_types or full_attn_idxs, and a layer kind LFM2 lacks refused by name."""
    assert feed_forward_width({"block_ff_dim": 12288, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0,
                               "block_multiple_of": 256}) == 8192  # fmt: skip
    assert feed_forward_width({"intermediate_size": 100, "block_auto_adjust_ff_dim": False}) == 100
    raw = {"model_type": "lfm2", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2, "full_attn_idxs": [1], "block_multiple_of": 16}  # fmt: skip
    config = lfm2_config(raw, config_from_hf)
    assert config.layer_types == ("conv", "attention", "conv") and config.decoder.rope_theta == 1000000.0
    assert config.decoder.tie_word_embeddings and config.mixer.conv_kernel == 3
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        lfm2_config({**raw, "layer_types": ["conv", "sliding_attention", "conv"]}, config_from_hf)
    with pytest.raises(ModelLoadError, match="hidden_size"):
        lfm2_config({k: v for k, v in raw.items() if k != "hidden_size"}, config_from_hf)


def test_lfm2_moe_config_reads_its_mixture(built: dict) -> None:
    """LFM2-MoE: its first num_dense_layers run the SwiGLU intermediate_size wide (no adjustment),
    the rest the mixture, scored by sigmoid with the choice bias, renormalised and scaled."""
    _, llm, _ = built["lfm2-moe"]
    d = llm.config.decoder
    assert (d.moe_layers, d.intermediate_size, d.expert_intermediate_size) == ((2, 3, 4), 96, 32)
    assert (d.expert_scoring, d.normalize_expert_weights, d.routed_scaling_factor, d.experts_per_token) == ("sigmoid", True, 1.5, 2)
    mlps = [type(block.mlp).__name__ for block in llm.model.layers]
    assert mlps == ["GatedMLP", "GatedMLP", "SparseMoE", "SparseMoE", "SparseMoE"]
    assert llm.model.layers[2].mlp.choice_bias is not None

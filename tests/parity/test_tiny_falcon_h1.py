"""Falcon-H1 (attention and Mamba-2 side by side in every layer, µP multipliers folded into the
weights) against transformers' FalconH1ForCausalLM on the same weights: logits, greedy tokens, the
C decode step and rows, the chunk-invariant prefill, sessions, the engine and its prefix cache, GGUF.

No Falcon-H1 checkpoint installs offline: these are small random-weight models that transformers
itself builds and saves (tests/support/tiny_hf.py): 3 layers, each 4 query / 2 KV heads with RoPE
beside a Mamba-2 mixer of 8 heads in 2 groups, then a SwiGLU, every multiplier away from 1; one
without the mixer's gated norm (Falcon-H1's mamba_rms_norm: false) and one with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from kvgen import LLM, SamplingParams
from kvgen.errors import UnsupportedModelError
from kvgen.loading.falcon_h1 import falcon_h1_config
from kvgen.loading.hf import config_from_hf
from tests.support.models import PROMPTS, model_path
from tests.support.recurrent import (assert_logits_follow_transformers, assert_engine_tokens_equal_each_request_alone,
                                     assert_engine_and_prefix_hit_follow_transformers, assert_prefill_is_chunk_invariant,
                                     assert_c_rows_equal_each_row_alone, assert_c_step_follows_torch,
                                     assert_session_resumes_from_a_checkpoint, random_ids,
                                     transformers_greedy)  # fmt: skip
from tests.support.tiny_gguf import write_falcon_h1_gguf
from tests.support.tiny_hf import save_tiny_falcon_h1, tokenizer_folder

pytestmark = pytest.mark.slow
TOLERANCE = 1e-3
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
MODELS = ["falcon-h1", "falcon-h1-norm"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, LLM, LLM]]:
    tokenizer = tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))
    models = {}
    for name in MODELS:
        folder = tmp_path_factory.mktemp(name)
        model = save_tiny_falcon_h1(folder, tokenizer, rms_norm=name.endswith("norm"))
        models[name] = model, LLM.load(folder, progress=False, weights="fp32"), LLM.load(folder, progress=False, weights="int8")
    return models


@pytest.mark.parametrize("name", MODELS)
def test_prefill_and_decode_logits_match(name: str, built: dict) -> None:
    """Every position of a 40-token prefill (split at checkpoints every 16) and 6 decode steps
    against transformers' forward over the same tokens (measured 5-7e-7: the multipliers folded
    into the weights move the logits by rounding only)."""
    model, llm, _ = built[name]
    assert_logits_follow_transformers(model, llm, 40, 16, TOLERANCE)


def test_greedy_tokens_match_transformers_generate(built: dict) -> None:
    model, llm, _ = built["falcon-h1"]
    for prompt in PROMPTS[:2]:
        ids = llm.tokenizer.encode(prompt)
        assert llm.generate(ids, GREEDY).token_ids == transformers_greedy(model, ids, GREEDY.max_new_tokens)


@pytest.mark.parametrize("name", MODELS)
def test_c_decode_step_follows_the_torch_step(name: str, built: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 projections decode layer by layer in C: a layer's attention block (no MLP in it), then its
    Mamba-2 step reading the input the attention read (kvgen_mamba2_step_from), then its SwiGLU; the
    torch step over the same linears gives the same logits up to the order of float sums."""
    _, _, int8 = built[name]
    assert int8.model._c_step() is not None
    assert_c_step_follows_torch(int8, random_ids(20, 10), random_ids(16, 11), monkeypatch)


@pytest.mark.parametrize("name", MODELS)
def test_c_rows_of_several_sequences_equal_each_alone(name: str, built: dict) -> None:
    """The engine's one-token rows of three sequences go through each layer together in C: logits,
    states, keys and values bit for bit as each row alone; the engine decodes what each request
    does alone."""
    _, _, int8 = built[name]
    assert_c_rows_equal_each_row_alone(int8, [random_ids(n, 20 + n) for n in (9, 30, 17)], random_ids(3, 12))
    assert_engine_tokens_equal_each_request_alone(int8, GREEDY)


def test_prefill_gives_the_same_bits_however_the_prompt_is_split(built: dict) -> None:
    """A prompt's attention rows run as decodes of their tokens (HybridStep.prompt_block, a block
    without the MLP) and the mixer reads the input they read, so chunking does not move logits."""
    _, _, int8 = built["falcon-h1"]
    assert_prefill_is_chunk_invariant(int8, random_ids(70, 31), [[66, 4], [31, 39], [1, 69], [17, 17, 36]])


def test_session_resumes_from_a_checkpoint(built: dict) -> None:
    _, llm, _ = built["falcon-h1"]
    assert_session_resumes_from_a_checkpoint(llm, GREEDY, random_ids(150, 3), random_ids(20, 4), random_ids(30, 5))


def test_engine_rows_and_prefix_cache_match_transformers(built: dict) -> None:
    """Prompts of different lengths run together; a prompt sharing 52 tokens with an earlier one
    resumes at the last block boundary inside them (states and keys restored) and decodes
    transformers' tokens."""
    model, llm, _ = built["falcon-h1"]
    assert_engine_and_prefix_hit_follow_transformers(model, llm, GREEDY, PROMPTS[:2])


@pytest.mark.parametrize("name", MODELS)
def test_gguf_loads_the_same_model(name: str, built: dict, tmp_path: Path) -> None:
    """An all-F32 `falcon-h1` file as llama.cpp's converter writes it (every multiplier already in
    the tensors): the same mixer and transformers' logits; a Q8_0 file, its blocks kept (int8),
    decodes in C and stays near them."""
    model, llm, _ = built[name]
    from_gguf = LLM.load(write_falcon_h1_gguf(tmp_path / "f32.gguf", model, model_path("smollm2")), progress=False, weights="fp32")
    ours, theirs = from_gguf.config, llm.config
    assert (ours.layer_types, ours.architecture) == (theirs.layer_types, "falcon_h1")
    mixer = ("num_heads", "head_dim", "n_groups", "state_size", "conv_kernel", "num_layers", "gated_norm")
    assert [getattr(ours.mixer, key) for key in mixer] == [getattr(theirs.mixer, key) for key in mixer]
    prompt = random_ids(40, 9)
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0]
        actual = from_gguf.model(torch.tensor([prompt]), from_gguf.generator.new_cache(0), logits_to_keep=len(prompt))[0]
        assert (actual - expected).abs().max().item() < TOLERANCE
        q8 = LLM.load(write_falcon_h1_gguf(tmp_path / "q8.gguf", model, model_path("smollm2"), gguf.GGMLQuantizationType.Q8_0),
                      progress=False, weights="int8")  # fmt: skip
        quantized = q8.model(torch.tensor([prompt]), q8.generator.new_cache(0), logits_to_keep=len(prompt))[0]
    assert q8.model._c_step() is not None
    assert (quantized - expected).abs().mean().item() < 0.02
    assert (quantized.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.85


def test_config_refuses_what_it_does_not_fold(built: dict) -> None:
    """Every layer parallel; biases (which the multipliers would have to scale too) and a norm before
    the mixer's gate are refused by name."""
    _, llm, _ = built["falcon-h1"]
    assert llm.config.layer_types == ("parallel",) * 3 and llm.config.rope and not llm.config.mixer.gated_norm
    block = llm.model.layers[0]
    assert block.attn is not None and block.mixer is not None and block.mlp is not None and (block.kv_slot, block.state_slot) == (0, 0)
    raw = {"model_type": "falcon_h1", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_state": 16}  # fmt: skip
    assert falcon_h1_config(raw, config_from_hf).mixer.head_dim == 16
    with pytest.raises(UnsupportedModelError, match="projectors_bias"):
        falcon_h1_config({**raw, "projectors_bias": True}, config_from_hf)
    with pytest.raises(UnsupportedModelError, match="mamba_norm_before_gate"):
        falcon_h1_config({**raw, "mamba_rms_norm": True, "mamba_norm_before_gate": True}, config_from_hf)

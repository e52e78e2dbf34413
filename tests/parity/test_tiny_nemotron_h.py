"""Nemotron-H (Mamba-2, attention and ReLU² MLP layers, one sublayer each) against transformers'
NemotronHForCausalLM on the same weights: logits, greedy tokens, the C decode step and rows, the
chunk-invariant prefill, sessions, the engine and its prefix cache, and GGUF; Nemotron 3 Nano's
kind (mixtures of ReLU² experts in place of the MLPs) the same way.

No Nemotron-H checkpoint installs offline: these are small random-weight models that transformers
itself builds and saves (tests/support/tiny_hf.py): the layer pattern M-M*-M- (Mamba-2 with 8 heads
in 2 groups, one NoPE attention layer, ReLU² MLPs), and the same with a mixture of 4 experts (2 a
token, sigmoid scores plus a choice bias, scaled by 1.5) and a shared expert in each MLP layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from kvgen import LLM, SamplingParams
from kvgen.errors import UnsupportedModelError
from kvgen.loading.hf import config_from_hf, load_hf_folder
from kvgen.loading.nemotron_h import nemotron_h_config
from tests.support.models import PROMPTS, model_path
from tests.support.recurrent import (assert_logits_follow_transformers, assert_engine_tokens_equal_each_request_alone,
                                     assert_engine_and_prefix_hit_follow_transformers, assert_prefill_is_chunk_invariant,
                                     assert_c_rows_equal_each_row_alone, assert_c_step_follows_torch,
                                     assert_session_resumes_from_a_checkpoint, random_ids,
                                     transformers_greedy)  # fmt: skip
from tests.support.tiny_gguf import write_nemotron_h_gguf
from tests.support.tiny_hf import save_tiny_nemotron_h, tokenizer_folder

pytestmark = pytest.mark.slow
TOLERANCE = 1e-3
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
MODELS = ["nemotron-h", "nemotron-h-moe"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, LLM, LLM]]:
    tokenizer = tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))
    models = {}
    for name, experts in (("nemotron-h", 0), ("nemotron-h-moe", 4)):
        folder = tmp_path_factory.mktemp(name)
        model = save_tiny_nemotron_h(folder, tokenizer, experts=experts)
        models[name] = model, LLM.load(folder, progress=False, weights="fp32"), LLM.load(folder, progress=False, weights="int8")
    return models


@pytest.mark.parametrize("name", MODELS)
def test_prefill_and_decode_logits_match(name: str, built: dict) -> None:
    """Every position of a 40-token prefill (split at checkpoints every 16) and 6 decode steps
    against transformers' forward over the same tokens (measured 2.6e-4 and 7e-5: transformers'
    chunked scan takes differences of long cumulative sums of the decays, kvgen runs the recurrence)."""
    model, llm, _ = built[name]
    assert_logits_follow_transformers(model, llm, 40, 16, TOLERANCE)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_match_transformers_generate(name: str, built: dict) -> None:
    model, llm, _ = built[name]
    for prompt in PROMPTS[:2]:
        ids = llm.tokenizer.encode(prompt)
        assert llm.generate(ids, GREEDY).token_ids == transformers_greedy(model, ids, GREEDY.max_new_tokens)


@pytest.mark.parametrize("name", MODELS)
def test_c_decode_step_follows_the_torch_step(name: str, built: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 projections decode layer by layer in C (Mamba-2 as kvgen_mamba2_step_from, attention without
    an MLP, the ReLU² MLP and mixture as the transformer blocks' kernels with activation 3): the torch
    step over the same linears gives the same logits up to the order of float sums."""
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


@pytest.mark.parametrize("name", MODELS)
def test_prefill_gives_the_same_bits_however_the_prompt_is_split(name: str, built: dict) -> None:
    """The attention layer's prompt rows run as decodes of their tokens (HybridStep.prompt_block,
    here a block without an MLP), and the rest is row-invariant, so chunking does not move logits."""
    _, _, int8 = built[name]
    assert_prefill_is_chunk_invariant(int8, random_ids(70, 31), [[66, 4], [31, 39], [1, 69], [17, 17, 36]])


def test_a_mixture_prompt_on_q4_weights_gives_the_same_bits_however_split(tmp_path: Path) -> None:
    """On 4-bit weights a prompt's mixture layers ran torch's matmuls, whose sums a chunk of a few
    tokens (the C step) did not share (3e-7 in the last logits, enough to flip a near-tied router);
    they run as the decode step's rows now (HybridStep.prompt_mlp), whatever the chunks."""
    save_tiny_nemotron_h(tmp_path / "model", tokenizer_folder(tmp_path / "tokenizer"), experts=4)
    q4 = LLM.load(tmp_path / "model", progress=False, weights="q4")
    assert q4.model._c_step() is not None  # the chunks of a few tokens take the C step
    assert_prefill_is_chunk_invariant(q4, random_ids(70, 31), [[66, 4], [62, 8], [69, 1], [31, 39]])


def test_session_resumes_from_a_checkpoint(built: dict) -> None:
    _, llm, _ = built["nemotron-h"]
    assert_session_resumes_from_a_checkpoint(llm, GREEDY, random_ids(150, 3), random_ids(20, 4), random_ids(30, 5))


def test_engine_rows_and_prefix_cache_match_transformers(built: dict) -> None:
    """Prompts of different lengths run together (prefills chunked beside decodes); a prompt sharing
    52 tokens with an earlier one resumes at the last block boundary inside them and decodes
    transformers' tokens; the prefix cache's units are all the budget holds once the requests end."""
    model, llm, _ = built["nemotron-h"]
    assert_engine_and_prefix_hit_follow_transformers(model, llm, GREEDY, PROMPTS[:2])


@pytest.mark.parametrize("name", MODELS)
def test_gguf_loads_the_same_model(name: str, built: dict, tmp_path: Path) -> None:
    """An all-F32 `nemotron_h` (`nemotron_h_moe`) file as llama.cpp's converter writes it: the same
    config and transformers' logits; a Q8_0 file, its blocks kept (int8), decodes in C and stays near them
    (that file also counts a trailing multi-token-prediction block, which kvgen leaves unread).
    ReLU² MLPs square their inputs' rounding, so 8-bit weights move these random models' logits more than
    LFM2's (the int8 load of the HF folder: max 0.055, argmax the same at 37 of 40 positions)."""
    model, llm, _ = built[name]
    from_gguf = LLM.load(write_nemotron_h_gguf(tmp_path / "f32.gguf", model, model_path("smollm2")), progress=False, weights="fp32")
    ours, theirs = from_gguf.config, llm.config
    assert (ours.layer_types, ours.architecture, ours.mlp_every_layer) == (theirs.layer_types, "nemotron_h", False)
    mixer = ("num_heads", "head_dim", "n_groups", "state_size", "conv_kernel", "num_layers", "use_conv_bias")
    assert [getattr(ours.mixer, key) for key in mixer] == [getattr(theirs.mixer, key) for key in mixer]
    keys = ("intermediate_size", "hidden_act", "num_experts", "experts_per_token", "expert_intermediate_size", "moe_layers",
            "expert_scoring", "routed_scaling_factor", "shared_expert_intermediate_size", "shared_expert_gated")
    keys = keys[1:] if ours.decoder.num_experts else keys  # a mixture model has no dense MLP width
    assert [getattr(ours.decoder, key) for key in keys] == [getattr(theirs.decoder, key) for key in keys]
    prompt = random_ids(40, 9)
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0]
        actual = from_gguf.model(torch.tensor([prompt]), from_gguf.generator.new_cache(0), logits_to_keep=len(prompt))[0]
        assert (actual - expected).abs().max().item() < TOLERANCE
        q8_file = write_nemotron_h_gguf(tmp_path / "q8.gguf", model, model_path("smollm2"), gguf.GGMLQuantizationType.Q8_0,
                                        rms_epsilon=False, mtp_layers=1)  # the first converter's epsilon key; an MTP block's metadata
        q8 = LLM.load(q8_file, progress=False, weights="int8")
        quantized = q8.model(torch.tensor([prompt]), q8.generator.new_cache(0), logits_to_keep=len(prompt))[0]
    assert q8.model._c_step() is not None and q8.config.decoder.rms_norm_eps == ours.decoder.rms_norm_eps
    assert q8.config.layer_types == ours.layer_types  # the trailing MTP block left unread
    # as near as the folder's own int8 load (mean 0.006 / 0.008 against logits' std 0.29; a mixture's
    # near-tied routes flip under 8-bit rounding, so its largest difference reads 0.25 either way)
    assert (quantized - expected).abs().mean().item() < 0.02
    assert (quantized.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.85  # measured 0.90 / 0.95


def test_config_reads_the_pattern_and_refuses_what_it_does_not_run(built: dict) -> None:
    """Layer kinds from hybrid_override_pattern (NVIDIA's configs) or layers_block_type (transformers'),
    each layer one sublayer; a latent mixture (Nemotron 3 Super's) and another MLP activation are
    refused by name."""
    _, llm, _ = built["nemotron-h"]
    assert llm.config.layer_types == ("mamba", "mlp", "mamba", "attention", "mlp", "mamba", "mlp")
    kinds = [(type(b.mixer).__name__, type(b.attn).__name__, type(b.mlp).__name__) for b in llm.model.layers[:4]]
    assert kinds == [("Mamba2Mixer", "NoneType", "NoneType"), ("NoneType", "NoneType", "ReluSquaredMLP"),
                     ("Mamba2Mixer", "NoneType", "NoneType"), ("NoneType", "Attention", "NoneType")]  # fmt: skip
    raw = {"model_type": "nemotron_h", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2,
           "ssm_state_size": 16, "hybrid_override_pattern": "M*-E", "n_routed_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48}  # fmt: skip
    config = nemotron_h_config(raw, config_from_hf)
    assert config.layer_types == ("mamba", "attention", "mlp", "mlp") and config.decoder.moe_layers == (3,)
    assert config.decoder.hidden_act == "relu2" and not config.rope
    with pytest.raises(UnsupportedModelError, match="moe_latent_size"):
        nemotron_h_config({**raw, "moe_latent_size": 16}, config_from_hf)
    with pytest.raises(UnsupportedModelError, match="mlp_hidden_act"):
        nemotron_h_config({**raw, "mlp_hidden_act": "silu"}, config_from_hf)
    with pytest.raises(UnsupportedModelError, match="X"):
        nemotron_h_config({**raw, "hybrid_override_pattern": "M*X"}, config_from_hf)


def test_multi_token_prediction_tensors_in_a_folder_are_never_read(built: dict, tmp_path: Path) -> None:
    """An HF folder's `mtp.*` tensors (NVIDIA ships one MTP block beside the model) and a layer past
    the config's count (DeepSeek-V3's MTP layer) are left on disk: written here as NaN, which the
    loader refuses in any tensor it reads, they load the same model with none of their names."""
    from safetensors.torch import save_file

    model, llm, _ = built["nemotron-h"]
    tokenizer = tokenizer_folder(tmp_path / "tokenizer")
    folder = tmp_path / "with-mtp"
    save_tiny_nemotron_h(folder, tokenizer)
    nan = torch.full((8, 8), float("nan"))
    save_file({"mtp.layers.0.mixer.q_proj.weight": nan, "backbone.layers.7.mixer.in_proj.weight": nan.clone()},
              str(folder / "mtp.safetensors"))  # fmt: skip
    assert not [name for name in load_hf_folder(folder, progress=False).tensors if "mtp" in name or ".layers.7." in name]
    with_mtp = LLM.load(folder, progress=False, weights="fp32")
    prompt = random_ids(12, 6)
    assert with_mtp.generate(prompt, GREEDY).token_ids == llm.generate(prompt, GREEDY).token_ids

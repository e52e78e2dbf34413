"""Liquid's LFM2 (HF `lfm2`, llama.cpp's `lfm2`: LFM2-350M, -700M, -1.2B, -2.6B) and LFM2-MoE (HF
`lfm2_moe`: LFM2-8B-A1B): config.json or GGUF metadata -> HybridConfig, and the checkpoint's names
-> the ones models/granite_hybrid.py reads.

A layer is a gated short convolution (`model.layers.N.conv.*`, models/short_conv.py) or grouped-query
attention with an RMSNorm over each head's q and k and RoPE (`self_attn.out_proj`, `q_layernorm`,
`k_layernorm`); every layer then runs a SwiGLU (`feed_forward.w1` gate, `w3` up, `w2` down) after
`ffn_norm`; `operator_norm` comes before the mixer, and `model.embedding_norm` is the final norm.
LFM2-MoE's layers past its first `num_dense_layers` run a mixture instead of the SwiGLU: experts
chosen by sigmoid scores plus a per-expert bias (`feed_forward.expert_bias`, choosing only), their
weights renormalised (`norm_topk_prob`) and scaled (`routed_scaling_factor`), as DeepSeek-V3's
router (models/moe.py); its dense SwiGLU is `intermediate_size` wide as given.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import torch

from kvgen.config import HybridConfig, ModelConfig, ShortConvConfig
from kvgen.errors import ModelLoadError, UnsupportedModelError
from kvgen.kernels.formats import QuantizedWeight
from kvgen.loading.granite_hybrid import gguf_layer_kinds

_LAYER_KINDS = {"conv": "conv", "full_attention": "attention", "attention": "attention"}
_HF_NAMES = tuple((re.compile(pattern), replacement) for pattern, replacement in (
    (r"^(model\.layers\.\d+)\.operator_norm\.", r"\1.input_layernorm."),
    (r"^(model\.layers\.\d+)\.ffn_norm\.", r"\1.post_attention_layernorm."),
    (r"^(model\.layers\.\d+)\.feed_forward\.w1\.", r"\1.mlp.gate_proj."),
    (r"^(model\.layers\.\d+)\.feed_forward\.w3\.", r"\1.mlp.up_proj."),
    (r"^(model\.layers\.\d+)\.feed_forward\.w2\.", r"\1.mlp.down_proj."),
    (r"^(model\.layers\.\d+)\.self_attn\.out_proj\.", r"\1.self_attn.o_proj."),
    (r"^(model\.layers\.\d+)\.self_attn\.q_layernorm\.", r"\1.self_attn.q_norm."),
    (r"^(model\.layers\.\d+)\.self_attn\.k_layernorm\.", r"\1.self_attn.k_norm."),
    (r"^model\.embedding_norm\.", "model.norm."),
    (r"^(model\.layers\.\d+)\.feed_forward\.gate\.", r"\1.mlp.gate."),  # LFM2-MoE's router
    (r"^(model\.layers\.\d+)\.feed_forward\.expert_bias$", r"\1.mlp.gate.e_score_correction_bias"),
    (r"^(model\.layers\.\d+)\.feed_forward\.experts\.(\d+)\.w1\.", r"\1.mlp.experts.\2.gate_proj."),
    (r"^(model\.layers\.\d+)\.feed_forward\.experts\.(\d+)\.w3\.", r"\1.mlp.experts.\2.up_proj."),
    (r"^(model\.layers\.\d+)\.feed_forward\.experts\.(\d+)\.w2\.", r"\1.mlp.experts.\2.down_proj."),
    (r"^(model\.layers\.\d+)\.feed_forward\.experts\.", r"\1.mlp.experts."),  # stacked: gate_up_proj, down_proj
))  # fmt: skip
# llama.cpp's names for the short conv and the final norm (the rest are the llama names gguf.py reads)
_GGUF_BIAS = re.compile(r"^blk\.(\d+)\.exp_probs_b\.bias$")
_GGUF_CONV = re.compile(r"^blk\.(\d+)\.shortconv\.(conv|in_proj|out_proj)\.(weight|bias)$")


def feed_forward_width(raw: dict[str, Any]) -> int:
    """transformers' Lfm2MLP width: block_ff_dim (or intermediate_size), cut to 2/3, times
    block_ffn_dim_multiplier and rounded up to block_multiple_of, where block_auto_adjust_ff_dim
    (LFM2-MoE's dense MLP: intermediate_size as it is)."""
    width = int(raw.get("block_ff_dim") or raw["intermediate_size"])
    if raw.get("model_type") != "lfm2_moe" and raw.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if (multiplier := raw.get("block_ffn_dim_multiplier", 1.0)) is not None:
            multiple = int(raw.get("block_multiple_of", 256))
            width = multiple * ((int(float(multiplier) * width) + multiple - 1) // multiple)
    return width


def lfm2_config(raw: dict[str, Any], decoder_config: Callable[[dict[str, Any]], ModelConfig]) -> HybridConfig:
    """`decoder_config`: hf.py's reader of a decoder's config.json, which reads the attention and the
    SwiGLU as Llama's."""
    try:
        num_layers = int(raw["num_hidden_layers"])
        kinds = raw.get("layer_types")
        if kinds is None:
            attention = set(raw.get("full_attn_idxs") or range(num_layers))
            kinds = ["full_attention" if i in attention else "conv" for i in range(num_layers)]
        if unknown := set(kinds) - set(_LAYER_KINDS):
            raise UnsupportedModelError(f"config.json's layer_types name {sorted(unknown)}; an lfm2 model has 'conv' and "
                                        "'full_attention' layers")  # fmt: skip
        layer_types = tuple(_LAYER_KINDS[kind] for kind in kinds)
        mixer = ShortConvConfig(hidden_size=int(raw["hidden_size"]), conv_kernel=int(raw.get("conv_L_cache", 3)),
                                num_layers=layer_types.count("conv"), use_bias=bool(raw.get("conv_bias", False)))  # fmt: skip
        tied = raw.get("tie_embedding", raw.get("tie_word_embeddings", True))
        theta = {} if "rope_theta" in raw or "rope_parameters" in raw else {"rope_theta": 1000000.0}  # transformers' default for lfm2
        decoder = decoder_config({**raw, **theta, "model_type": "llama", "intermediate_size": feed_forward_width(raw),
                                  "rms_norm_eps": raw.get("norm_eps", 1e-5), "tie_word_embeddings": tied,
                                  "max_position_embeddings": raw.get("max_position_embeddings", 128000)})  # fmt: skip
        if raw.get("model_type") == "lfm2_moe":
            decoder = dataclasses.replace(
                decoder, num_experts=int(raw["num_experts"]), experts_per_token=int(raw["num_experts_per_tok"]),
                expert_intermediate_size=int(raw["moe_intermediate_size"]), expert_scoring="sigmoid",
                normalize_expert_weights=bool(raw.get("norm_topk_prob", True)),
                routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
                moe_layers=tuple(range(int(raw.get("num_dense_layers", 2)), num_layers)),
            )  # fmt: skip
    except KeyError as error:
        raise ModelLoadError(f"config.json lacks {error}; it is not a complete {raw.get('model_type')} config") from error
    return HybridConfig(decoder, mixer, layer_types, rope=True, architecture="lfm2")


def lfm2_config_from_gguf(metadata: dict[str, Any], tensor_names: set[str], get: Callable[[str], Any],
                          decoder_config: Callable[[dict[str, Any], set[str]], ModelConfig]) -> HybridConfig:  # fmt: skip
    """llama.cpp's `lfm2` and `lfm2moe` keys (`get`: config_from_gguf's reader of them): the attention layers are those with KV heads (the
    per-layer attention.head_count_kv, 0 for a conv layer), the conv's taps shortconv.l_cache; the
    rest is read as a `llama` file by `decoder_config` (gguf.py's config_from_gguf), a mixture's
    experts from expert_count / expert_used_count / expert_feed_forward_length in the layers with a
    router (after leading_dense_block_count), scored by sigmoid (expert_gating_func 2)."""
    arch = metadata.get("general.architecture", "lfm2")
    layer_types, kv_heads = gguf_layer_kinds(get, "conv")
    renamed = {(f"llama.{k[len(arch) + 1 :]}" if k.startswith(f"{arch}.") else k): v for k, v in metadata.items()}
    renamed |= {"general.architecture": "llama", "llama.attention.head_count_kv": max(int(n) for n in kv_heads)}
    decoder = decoder_config(renamed, tensor_names)
    if decoder.num_experts:
        gating = int(metadata.get(f"{arch}.expert_gating_func") or 2)
        if gating != 2:
            raise UnsupportedModelError(f"{arch}.expert_gating_func {gating} is not sigmoid (2), which LFM2-MoE's router uses")
        decoder = dataclasses.replace(decoder, expert_scoring="sigmoid",
                                      routed_scaling_factor=float(metadata.get(f"{arch}.expert_weights_scale") or 1.0))  # fmt: skip
    mixer = ShortConvConfig(hidden_size=decoder.hidden_size, conv_kernel=int(get("shortconv.l_cache")),
                            num_layers=layer_types.count("conv"), use_bias=any(".shortconv.in_proj.bias" in n for n in tensor_names))  # fmt: skip
    return HybridConfig(decoder, mixer, layer_types, rope=True, architecture="lfm2")


def lfm2_gguf_name(gguf_name: str) -> str | None:
    """The HF name of an lfm2 file's short-conv tensor, final norm or expert choice bias (None: none of them)."""
    if gguf_name == "token_embd_norm.weight":  # llama.cpp's name for LFM2's final norm (model.embedding_norm)
        return "model.norm.weight"
    if match := _GGUF_BIAS.match(gguf_name):  # LFM2-MoE's expert_bias
        return f"model.layers.{match.group(1)}.mlp.gate.e_score_correction_bias"
    if match := _GGUF_CONV.match(gguf_name):
        layer, part, suffix = match.groups()
        return f"model.layers.{layer}.conv.{part}.{suffix}"
    return None


def name_lfm2_weights(tensors: dict[str, torch.Tensor | QuantizedWeight]) -> None:
    """In place: LFM2's HF names -> the Llama names the hybrid's blocks read (see the module docstring)."""
    for name in list(tensors):
        for pattern, replacement in _HF_NAMES:
            if pattern.match(name):
                tensors[pattern.sub(replacement, name)] = tensors.pop(name)
                break

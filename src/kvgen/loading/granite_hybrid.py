"""Granite 4.0-H (HF `granitemoehybrid`: Granite-4.0-H-Micro, -Tiny, -Small; llama.cpp's
`granitehybrid`) and Bamba (HF `bamba`, the hybrid Granite 4.0-H grew from): config.json or GGUF
metadata -> HybridConfig, and the checkpoint's names -> the ones models/granite_hybrid.py reads.

A layer is a Mamba-2 mixer (`model.layers.N.mamba.*`, read as Mamba-2's) or attention (q/k/v/o,
scaled by attention_multiplier, with RoPE only where position_embedding_type is "rope"); every
layer then runs a SwiGLU `shared_mlp` and, where num_local_experts > 0, beside it a mixture as
Granite-MoE's (its router's softmax over the chosen experts). Granite's scalars as Granite 3's.
Bamba is the same stack without scalars or experts: attention layers at `attn_layer_indices`,
always turned by RoPE over half of each head (transformers fixes partial_rotary_factor at 0.5), a
SwiGLU `feed_forward` after `pre_ff_layernorm`, and `model.final_layernorm`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import torch

from kvgen.config import HybridConfig, Mamba2Config, ModelConfig
from kvgen.errors import ModelLoadError
from kvgen.kernels.formats import QuantizedWeight
from kvgen.loading.mamba2 import refuse_unhonoured

_LAYER_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention"}
_SHARED_MLP = re.compile(r"^(model\.layers\.\d+)\.shared_mlp\.(input|output)_linear\.weight$")
# llama.cpp's Mamba-2 tensors in a granitehybrid file -> the layer's `mamba` mixer (GGUF: A itself, not A_log)
_GGUF_MAMBA = {("ssm_in", "weight"): "in_proj.weight", ("ssm_conv1d", "weight"): "conv1d.weight", ("ssm_conv1d", "bias"): "conv1d.bias",
               ("ssm_dt", "bias"): "dt_bias", ("ssm_a", None): "A", ("ssm_d", None): "D", ("ssm_norm", "weight"): "norm.weight",
               ("ssm_out", "weight"): "out_proj.weight"}  # fmt: skip
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.(ssm_\w+?)(?:\.(weight|bias))?$")
# Bamba's names -> Granite 4.0-H's (a dense MLP, the norm before it, the final norm)
_BAMBA_NAMES = ((re.compile(r"^(model\.layers\.\d+)\.feed_forward\."), r"\1.mlp."),
                (re.compile(r"^(model\.layers\.\d+)\.pre_ff_layernorm\."), r"\1.post_attention_layernorm."),
                (re.compile(r"^model\.final_layernorm\."), "model.norm."))  # fmt: skip


def granite_hybrid_config(raw: dict[str, Any], decoder_config: Callable[[dict[str, Any]], ModelConfig]) -> HybridConfig:
    """`decoder_config`: hf.py's reader of a decoder's config.json, which reads the attention, MLP and
    scalars as Granite-MoE's (Granite 3's where there are no experts)."""
    refuse_unhonoured(raw)  # Mamba-2's time_step_limit, activation and norm
    bamba = raw.get("model_type") == "bamba"
    try:
        if bamba:
            attention = set(raw.get("attn_layer_indices") or ())
            kinds = ["attention" if i in attention else "mamba" for i in range(int(raw["num_hidden_layers"]))]
        else:
            kinds = raw.get("layer_types") or raw["layers_block_type"]
        layer_types = tuple(_LAYER_KINDS[kind] for kind in kinds)
        experts = int(raw.get("num_local_experts") or 0)
        shared = int(raw["intermediate_size" if bamba else "shared_intermediate_size"])
        hidden, heads = int(raw["hidden_size"]), int(raw["mamba_n_heads"])
        inner = int(raw.get("mamba_expand", 2)) * hidden
        head_dim = raw.get("mamba_d_head", "auto")
        mamba = Mamba2Config(
            vocab_size=int(raw["vocab_size"]), hidden_size=hidden, num_heads=heads,
            head_dim=inner // heads if head_dim == "auto" else int(head_dim), n_groups=int(raw.get("mamba_n_groups", 1)),
            state_size=int(raw["mamba_d_state"]), conv_kernel=int(raw.get("mamba_d_conv", 4)),
            num_layers=layer_types.count("mamba"), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            chunk_size=int(raw.get("mamba_chunk_size", 256)), use_conv_bias=bool(raw.get("mamba_conv_bias", True)),
            use_bias=bool(raw.get("mamba_proj_bias", False)),
        )  # fmt: skip
    except KeyError as error:
        raise ModelLoadError(f"config.json lacks {error}; it is not a complete granitemoehybrid config") from error
    if mamba.intermediate_size != inner:
        raise ModelLoadError(f"config.json's mamba_n_heads x mamba_d_head ({mamba.intermediate_size}) must equal mamba_expand x "
                             f"hidden_size ({inner}); it is not a consistent granitemoehybrid config")  # fmt: skip
    if bamba:  # Llama attention over half-turned heads, a dense SwiGLU, no scalars
        decoder = decoder_config({**raw, "model_type": "llama", "partial_rotary_factor": 0.5})
        return HybridConfig(decoder, mamba, layer_types, rope=True)
    if experts:  # Granite-MoE's mixture, with the shared MLP as an ungated shared expert
        decoder = decoder_config({**raw, "model_type": "granitemoe", "num_local_experts": experts})
        decoder = dataclasses.replace(decoder, shared_expert_intermediate_size=shared, shared_expert_gated=False)
    else:  # Granite-4.0-H-Micro: the shared MLP alone, a dense SwiGLU
        decoder = decoder_config({**raw, "model_type": "granite", "intermediate_size": shared})
    return HybridConfig(decoder, mamba, layer_types, rope=raw.get("position_embedding_type") == "rope")


def granite_hybrid_config_from_gguf(metadata: dict[str, Any], tensor_names: set[str], get: Callable[[str], Any],
                                    decoder_config: Callable[[dict[str, Any], set[str]], ModelConfig]) -> HybridConfig:  # fmt: skip
    """llama.cpp's `granitehybrid` keys (`get`: config_from_gguf's reader of them): the attention layers are those with KV heads (the per-layer
    attention.head_count_kv, 0 for a Mamba layer); the rest is read as a `granitemoe` file (`granite`
    without experts) by `decoder_config` (gguf.py's config_from_gguf), the shared MLP
    expert_shared_feed_forward_length wide; attention turns by RoPE only where
    rope.scaling.finetuned says so (llama.cpp's converter writes false for Granite 4.0-H)."""
    arch = "granitehybrid"
    layer_types, kv_heads = gguf_layer_kinds(get, "mamba")
    experts = int(metadata.get(f"{arch}.expert_count", 0))
    shared = int(metadata.get(f"{arch}.expert_shared_feed_forward_length") or get("feed_forward_length"))
    as_decoder = "granitemoe" if experts else "granite"
    renamed = {(f"{as_decoder}.{k[len(arch) + 1 :]}" if k.startswith(f"{arch}.") else k): v for k, v in metadata.items()}
    renamed |= {"general.architecture": as_decoder, f"{as_decoder}.attention.head_count_kv": max(int(n) for n in kv_heads)}
    if not experts:
        renamed[f"{as_decoder}.feed_forward_length"] = shared
    decoder = decoder_config(renamed, tensor_names)
    if experts:
        decoder = dataclasses.replace(decoder, shared_expert_intermediate_size=shared, shared_expert_gated=False)
    rope = bool(metadata.get(f"{arch}.rope.scaling.finetuned", False))
    return HybridConfig(decoder, mamba2_config_from_gguf(get, decoder, layer_types, tensor_names), layer_types, rope=rope)


def mamba2_config_from_gguf(get: Callable[[str], Any], decoder: ModelConfig, layer_types: tuple[str, ...],
                            tensor_names: set[str]) -> Mamba2Config:  # fmt: skip
    """A hybrid file's Mamba-2 layers from llama.cpp's ssm.* keys (`get`: config_from_gguf's reader)."""
    inner, heads = int(get("ssm.inner_size")), int(get("ssm.time_step_rank"))
    return Mamba2Config(
        vocab_size=decoder.vocab_size, hidden_size=decoder.hidden_size, num_heads=heads, head_dim=inner // heads,
        n_groups=int(get("ssm.group_count")), state_size=int(get("ssm.state_size")), conv_kernel=int(get("ssm.conv_kernel")),
        num_layers=sum(kind in ("mamba", "parallel") for kind in layer_types), rms_norm_eps=decoder.rms_norm_eps,
        use_conv_bias=any(n.endswith("ssm_conv1d.bias") for n in tensor_names),
    )  # fmt: skip


def gguf_layer_kinds(get: Callable[[str], Any], state_kind: str) -> tuple[tuple[str, ...], list[int]]:
    """A hybrid file's layer kinds from its per-layer attention.head_count_kv (llama.cpp writes 0 for
    a state layer): ("attention" or `state_kind` per layer, the KV heads per layer)."""
    kv_heads = get("attention.head_count_kv")
    kv_heads = [int(n) for n in kv_heads] if isinstance(kv_heads, (list, tuple)) else [int(kv_heads)] * int(get("block_count"))
    return tuple("attention" if n else state_kind for n in kv_heads), kv_heads


def granite_hybrid_mamba_name(gguf_name: str) -> str | None:
    """The HF name of a granitehybrid file's Mamba-2 tensor (None: not one)."""
    if match := _GGUF_LAYER.match(gguf_name):
        layer, part, suffix = match.groups()
        if (part, suffix) in _GGUF_MAMBA:
            return f"model.layers.{layer}.mamba.{_GGUF_MAMBA[part, suffix]}"
    return None


def name_granite_hybrid_weights(tensors: dict[str, torch.Tensor | QuantizedWeight], config: HybridConfig) -> None:
    """In place: shared_mlp.input_linear [2 I, H] (gate rows first) and output_linear -> the shared
    expert's (mlp.shared_expert.*) where there is a mixture, else the layer's own MLP (mlp.*);
    Bamba's feed_forward, pre_ff_layernorm and final_layernorm -> mlp, post_attention_layernorm, norm."""
    part = "mlp.shared_expert" if config.decoder.num_experts else "mlp"
    for name in list(tensors):
        for pattern, replacement in _BAMBA_NAMES:
            if pattern.match(name):
                tensors[pattern.sub(replacement, name)] = tensors.pop(name)
                break
    for name in list(tensors):
        if match := _SHARED_MLP.match(name):
            layer, which = match.groups()
            weight = tensors.pop(name)
            assert isinstance(weight, torch.Tensor), f"{name} must be a float tensor"
            if which == "input":
                gate, up = weight.chunk(2, dim=0)
                tensors[f"{layer}.{part}.gate_proj.weight"], tensors[f"{layer}.{part}.up_proj.weight"] = gate, up
            else:
                tensors[f"{layer}.{part}.down_proj.weight"] = weight

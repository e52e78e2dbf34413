"""NVIDIA's Nemotron-H (HF `nemotron_h`: Nemotron-H 4B/8B/47B, Nemotron Nano 9B/12B v2, Nemotron 3
Nano 30B-A3B; llama.cpp's `nemotron_h` and `nemotron_h_moe`): config.json or GGUF metadata ->
HybridConfig, and the checkpoint's names -> the ones models/granite_hybrid.py reads.

Every layer is one sublayer behind one RMSNorm (`layers.N.norm`), its kind from
`layers_block_type` (or the pattern string `hybrid_override_pattern`: M Mamba-2, * attention, - MLP,
E mixture): a Mamba-2 mixer (`mixer.in_proj`, `conv1d`, `A_log`, `D`, `dt_bias`, a gated RMSNorm
over each of n_groups groups, `out_proj`), grouped-query attention without positions (NoPE, no
biases), an ungated MLP down(relu(up x)²), or a mixture of such experts chosen as DeepSeek-V3's are
(sigmoid scores plus `e_score_correction_bias`, which chooses and does not weigh; weights
renormalised and scaled by routed_scaling_factor) with an ungated shared expert beside them.

transformers' chunked prefill floors a Mamba step at time_step_min; its decode step does not, nor
does llama.cpp's: kvgen runs the steps unclamped, as those do, so a prompt and its decode agree.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import torch

from kvgen.config import HybridConfig, Mamba2Config, ModelConfig
from kvgen.errors import ModelLoadError, UnsupportedModelError
from kvgen.kernels.formats import QuantizedWeight
from kvgen.loading.granite_hybrid import gguf_layer_kinds, mamba2_config_from_gguf

# transformers' layer kinds (and the older names NVIDIA's configs use) -> HybridConfig's; "moe" is an
# MLP layer whose MLP is a mixture
_LAYER_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention",
                "mlp": "mlp", "moe": "moe"}  # fmt: skip
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_SUBLAYER = {"mamba": "mamba", "attention": "self_attn", "mlp": "mlp", "moe": "mlp"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(norm|mixer)\.(.+)$")
_EXPERT_PARTS = (
    (re.compile(r"^gate\.(weight|e_score_correction_bias)$"), r"gate.\1"),
    (re.compile(r"^experts\.(\d+)\.(up|down)_proj\.weight$"), r"experts.\1.\2_proj.weight"),
    (re.compile(r"^shared_experts\.(up|down)_proj\.weight$"), r"shared_expert.\1_proj.weight"),
)  # fmt: skip


def nemotron_h_layer_kinds(raw: dict[str, Any]) -> list[str]:
    """Each layer's kind ("mamba", "attention", "mlp" or "moe") from config.json."""
    kinds = raw.get("layers_block_type") or raw.get("layer_types")
    if kinds is None:
        pattern = raw.get("hybrid_override_pattern")
        if pattern is None:
            raise ModelLoadError("config.json has neither layers_block_type nor hybrid_override_pattern; it is not a complete "
                                 "nemotron_h config")  # fmt: skip
        if unknown := set(pattern) - set(_PATTERN):
            raise UnsupportedModelError(f"hybrid_override_pattern holds {sorted(unknown)}; a nemotron_h layer is M, *, - or E")
        return [_PATTERN[c] for c in pattern]
    if unknown := set(kinds) - set(_LAYER_KINDS):
        raise UnsupportedModelError(f"config.json's layers_block_type names {sorted(unknown)}; a nemotron_h layer is one of "
                                    f"{sorted(_LAYER_KINDS)}")  # fmt: skip
    return [_LAYER_KINDS[kind] for kind in kinds]


def _refuse_unhonoured(raw: dict[str, Any]) -> None:
    """Options kvgen does not run, refused by name rather than ignored."""
    if raw.get("moe_latent_size") is not None:
        raise UnsupportedModelError(f"moe_latent_size {raw['moe_latent_size']} (experts over a latent projection) is not "
                                    "supported; kvgen runs nemotron_h mixtures over the hidden size")  # fmt: skip
    if raw.get("mlp_hidden_act", "relu2") != "relu2":
        raise UnsupportedModelError(f"mlp_hidden_act {raw['mlp_hidden_act']!r} is not supported; kvgen runs nemotron_h MLPs with relu2")
    if raw.get("mamba_hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"mamba_hidden_act {raw['mamba_hidden_act']!r} is not supported; Mamba-2's convolution runs SiLU")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise UnsupportedModelError(f"{key}: true is not supported for nemotron_h; kvgen runs its projections without biases")


def nemotron_h_config(raw: dict[str, Any], decoder_config: Callable[[dict[str, Any]], ModelConfig]) -> HybridConfig:
    """`decoder_config`: hf.py's reader of a decoder's config.json, which reads the attention as Llama's."""
    _refuse_unhonoured(raw)
    kinds = nemotron_h_layer_kinds(raw)
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["mamba_num_heads"])
        attention_heads = int(raw["num_attention_heads"])
        head_dim = raw.get("head_dim") or raw.get("attention_head_dim") or hidden // attention_heads
        eps = float(raw.get("layer_norm_epsilon", 1e-5))
        mamba = Mamba2Config(
            vocab_size=int(raw["vocab_size"]), hidden_size=hidden, num_heads=heads, head_dim=int(raw["mamba_head_dim"]),
            n_groups=int(raw.get("n_groups", raw.get("mamba_n_groups", 8))), state_size=int(raw["ssm_state_size"]),
            conv_kernel=int(raw.get("conv_kernel", raw.get("mamba_d_conv", 4))), num_layers=kinds.count("mamba"), rms_norm_eps=eps,
            chunk_size=int(raw.get("chunk_size", 128)), use_conv_bias=bool(raw.get("use_conv_bias", True)),
            use_bias=bool(raw.get("mamba_proj_bias", raw.get("use_bias", False))),
        )  # fmt: skip
        decoder = decoder_config({**raw, "model_type": "llama", "num_hidden_layers": len(kinds), "head_dim": int(head_dim),
                                  "rms_norm_eps": eps, "intermediate_size": raw.get("intermediate_size") or raw["moe_intermediate_size"],
                                  "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False))})  # fmt: skip
        decoder = dataclasses.replace(decoder, hidden_act="relu2")
        if "moe" in kinds:
            decoder = dataclasses.replace(
                decoder, num_experts=int(raw["n_routed_experts"]), experts_per_token=int(raw["num_experts_per_tok"]),
                expert_intermediate_size=int(raw["moe_intermediate_size"]), expert_scoring="sigmoid",
                normalize_expert_weights=bool(raw.get("norm_topk_prob", True)),
                routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
                expert_groups=int(raw.get("n_group", 1)), expert_groups_used=int(raw.get("topk_group", 1)),
                shared_expert_intermediate_size=int(raw["moe_shared_expert_intermediate_size"]) if raw.get("n_shared_experts", 1) else 0,
                shared_expert_gated=False, moe_layers=tuple(i for i, kind in enumerate(kinds) if kind == "moe"),
            )  # fmt: skip
    except KeyError as error:
        raise ModelLoadError(f"config.json lacks {error}; it is not a complete nemotron_h config") from error
    layer_types = tuple("mlp" if kind == "moe" else kind for kind in kinds)
    return HybridConfig(decoder, mamba, layer_types, rope=False, architecture="nemotron_h", mlp_every_layer=False)


def nemotron_h_config_from_gguf(metadata: dict[str, Any], tensor_names: set[str], get: Callable[[str], Any],
                                decoder_config: Callable[[dict[str, Any], set[str]], ModelConfig]) -> HybridConfig:  # fmt: skip
    """llama.cpp's `nemotron_h` / `nemotron_h_moe` keys (`get`: config_from_gguf's reader of them):
    attention layers have KV heads (the per-layer attention.head_count_kv), MLP layers a
    feed_forward_length (per layer, 0 elsewhere) or a router, the rest are Mamba-2 layers; the
    attention and experts are read as a `llama` file by `decoder_config` (gguf.py's config_from_gguf)."""
    arch = metadata.get("general.architecture", "nemotron_h")
    layer_types, kv_heads = gguf_layer_kinds(get, "mamba")
    widths = get("feed_forward_length")
    widths = [int(n) for n in widths] if isinstance(widths, (list, tuple)) else [int(widths)] * len(layer_types)
    # llama.cpp's converter appends a multi-token-prediction head as trailing blocks (counted in
    # block_count): a speculative head, not part of the model's forward, so it is left unread
    layers = len(layer_types) - int(metadata.get(f"{arch}.nextn_predict_layers") or 0)
    layer_types, kv_heads, widths = layer_types[:layers], kv_heads[:layers], widths[:layers]
    routed = {layer for n in tensor_names if n.endswith("ffn_gate_inp.weight") and (layer := int(n.split(".")[1])) < layers}
    layer_types = tuple("mlp" if kind == "mamba" and (widths[i] or i in routed) else kind for i, kind in enumerate(layer_types))
    renamed = {(f"llama.{k[len(arch) + 1 :]}" if k.startswith(f"{arch}.") else k): v for k, v in metadata.items()}
    renamed |= {"general.architecture": "llama", "llama.attention.head_count_kv": max(int(n) for n in kv_heads),
                "llama.feed_forward_length": max(widths), "llama.block_count": layers}  # fmt: skip
    if "llama.attention.layer_norm_rms_epsilon" not in renamed:  # the key llama.cpp's first nemotron_h files used
        renamed["llama.attention.layer_norm_rms_epsilon"] = get("attention.layer_norm_epsilon")
    decoder = dataclasses.replace(decoder_config(renamed, tensor_names), hidden_act="relu2")
    if decoder.num_experts:
        gating = int(metadata.get(f"{arch}.expert_gating_func") or 2)
        if gating != 2:
            raise UnsupportedModelError(f"{arch}.expert_gating_func {gating} is not sigmoid (2), which Nemotron-H's router uses")
        decoder = dataclasses.replace(
            decoder, expert_scoring="sigmoid", moe_layers=tuple(sorted(routed)), shared_expert_gated=False,
            routed_scaling_factor=float(metadata.get(f"{arch}.expert_weights_scale") or 1.0),
            normalize_expert_weights=bool(metadata.get(f"{arch}.expert_weights_norm", True)),
            expert_groups=int(metadata.get(f"{arch}.expert_group_count") or 1),
            expert_groups_used=int(metadata.get(f"{arch}.expert_group_used_count") or 1),
        )  # fmt: skip
    mamba = mamba2_config_from_gguf(get, decoder, layer_types, tensor_names)
    return HybridConfig(decoder, mamba, layer_types, rope=False, architecture="nemotron_h", mlp_every_layer=False)


def name_nemotron_h_weights(tensors: dict[str, torch.Tensor | QuantizedWeight], config: HybridConfig) -> None:
    """In place: NVIDIA's names (backbone.* or transformers' model.*) -> the hybrid's. A layer's
    `norm` is its input_layernorm, or its post_attention_layernorm where the layer is an MLP (the
    block's MLP norm); `mixer.*` goes to the sublayer its kind names; stacked experts
    (`experts.up_proj` [E, I, H], `experts.down_proj` [E, H, I]) are split per expert."""
    for name in list(tensors):
        renamed = re.sub(r"^backbone\.", "model.", name)
        renamed = {"model.embeddings.weight": "model.embed_tokens.weight", "model.norm_f.weight": "model.norm.weight"}.get(renamed, renamed)
        if match := _LAYER.match(renamed):
            layer, part, rest = int(match.group(1)), match.group(2), match.group(3)
            kind = config.layer_types[layer]
            prefix = f"model.layers.{layer}"
            if part == "norm":
                renamed = f"{prefix}.{'post_attention_layernorm' if kind == 'mlp' else 'input_layernorm'}.{rest}"
            elif kind == "mlp" and rest in ("experts.up_proj", "experts.down_proj"):
                stacked = tensors.pop(name)
                assert isinstance(stacked, torch.Tensor), f"{name} must be a float tensor"
                for e, weight in enumerate(stacked):
                    tensors[f"{prefix}.mlp.experts.{e}.{rest.split('.')[1]}.weight"] = weight.contiguous()
                continue
            else:
                for pattern, replacement in _EXPERT_PARTS if kind == "mlp" else ():
                    if pattern.match(rest):
                        rest = pattern.sub(replacement, rest)
                        break
                renamed = f"{prefix}.{_SUBLAYER[kind]}.{rest}"
        if renamed != name:
            tensors[renamed] = tensors.pop(name)


def name_mlp_layer_norms(tensors: dict[str, torch.Tensor | QuantizedWeight], config: HybridConfig) -> None:
    """In place, for a GGUF's tensors: an MLP layer's one norm (llama.cpp's attn_norm, read as
    input_layernorm) is the norm before its MLP, post_attention_layernorm."""
    for layer, kind in enumerate(config.layer_types):
        if kind == "mlp":
            prefix = f"model.layers.{layer}"
            tensors[f"{prefix}.post_attention_layernorm.weight"] = tensors.pop(f"{prefix}.input_layernorm.weight")

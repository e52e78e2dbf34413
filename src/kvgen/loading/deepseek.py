"""DeepSeek-V2 and V3 checkpoints (V2-Lite, V2, V3 / R1, Moonlight, Kimi K2): the config's latent-attention and mixture settings, and
the weight renames and row orders kvgen's blocks read (models/mla.py, models/moe.py)."""

from __future__ import annotations

import math
import re
from typing import Any, Callable

import numpy as np
import torch

from kvgen.config import ModelConfig, RopeScaling, yarn_mscale
from kvgen.errors import ModelLoadError, UnsupportedModelError

_SHARED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp)\.shared_experts\.")


def deepseek_config(raw: dict[str, Any], common: dict[str, Any], rope: dict[str, Any], scaling: RopeScaling | None) -> ModelConfig:
    """The config of a DeepSeek-V2 or V3 folder: one KV head of qk_rope_head_dim + kv_lora_rank channels
    (the latent and the RoPE key), RoPE over the first qk_rope_head_dim, DeepSeek's score scale; from
    layer first_k_dense_replace on (every moe_layer_freq-th), n_routed_experts experts plus
    n_shared_experts shared ones moe_intermediate_size wide each, chosen as `_routing` reads."""
    try:
        rank, rope_dim = int(raw["kv_lora_rank"]), int(raw["qk_rope_head_dim"])
        nope, v_dim = int(raw["qk_nope_head_dim"]), int(raw["v_head_dim"])
        experts, width = int(raw["n_routed_experts"]), int(raw["moe_intermediate_size"])
        per_token, shared = int(raw["num_experts_per_tok"]), int(raw.get("n_shared_experts") or 0)
    except (KeyError, TypeError) as error:
        raise ModelLoadError(f"config.json lacks {error}; it is not a complete deepseek_v2 config") from error
    routing = _routing(raw)
    scale = float(nope + rope_dim) ** -0.5
    if scaling is not None and scaling.kind == "yarn" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling.factor, float(rope["mscale_all_dim"])) ** 2
    first_dense, frequency = int(raw.get("first_k_dense_replace") or 0), int(raw.get("moe_layer_freq") or 1)
    layers = tuple(i for i in range(common["num_layers"]) if i >= first_dense and i % frequency == 0)
    return _latent_config(
        {**common, "rope_theta": float(rope.get("rope_theta", 10000.0)), "rope_scaling": scaling,
         "attention_bias": bool(raw.get("attention_bias", False))}, scale, rank, int(raw.get("q_lora_rank") or 0), nope, rope_dim,
        v_dim, experts, per_token, width, shared, bool(raw.get("norm_topk_prob", False)), layers,
        float(raw.get("routed_scaling_factor") or 1.0), routing,
    )  # fmt: skip


def _routing(raw: dict[str, Any]) -> dict[str, Any]:
    """The expert routing of a deepseek_v2 or deepseek_v3 config: V2 softmax-scores the experts
    (topk_method greedy, or group_limited_greedy over n_group groups of which topk_group are used);
    V3 sigmoid-scores them, choosing with its e_score_correction_bias among the topk_group best of
    n_group groups (noaux_tc)."""
    v3 = raw.get("model_type") == "deepseek_v3"
    method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    scoring = raw.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    known = {("greedy", "softmax"), ("group_limited_greedy", "softmax"), ("noaux_tc", "sigmoid")}
    if (method, scoring) not in known or v3 != (method == "noaux_tc"):
        raise UnsupportedModelError(f"{raw.get('model_type')} expert routing topk_method={method!r}, scoring_func={scoring!r} "
                                    "is not supported; kvgen routes DeepSeek-V2's greedy and group_limited_greedy "
                                    "softmax routing and DeepSeek-V3's noaux_tc sigmoid routing")  # fmt: skip
    if v3 and raw.get("rope_interleave") is False:
        raise UnsupportedModelError("deepseek_v3 with rope_interleave=false is not supported; kvgen reads DeepSeek's "
                                    "interleaved RoPE rows, as DeepSeek's own checkpoints have them")  # fmt: skip
    grouped = method != "greedy" and int(raw.get("n_group") or 1) > 1
    return {"expert_scoring": scoring, "expert_groups": int(raw["n_group"]) if grouped else 1,
            "expert_groups_used": int(raw.get("topk_group") or 1) if grouped else 1}  # fmt: skip


def deepseek_config_from_gguf(metadata: dict[str, Any], get: Callable[..., Any], common: dict[str, Any]) -> ModelConfig:
    """llama.cpp's deepseek2 files: as converted since MLA's absorption (one KV head of key_length =
    kv_lora_rank + rope values, key_length_mla = nope + rope, value_length_mla = v, kv_b_proj split
    into attn_k_b and attn_v_b) or before (key_length nope + rope, value_length v, one attn_kv_b).
    YaRN's attention scale comes as rope.scaling.yarn_log_multiplier = 0.1 mscale_all_dim."""
    rank, rope_dim = int(get("attention.kv_lora_rank")), int(get("rope.dimension_count"))
    if metadata.get("deepseek2.attention.key_length_mla") is not None:
        qk_dim, v_dim = int(get("attention.key_length_mla")), int(get("attention.value_length_mla"))
    else:
        qk_dim, v_dim = int(get("attention.key_length")), int(get("attention.value_length"))
    gating = int(metadata.get("deepseek2.expert_gating_func") or 1)  # llama.cpp's 1 softmax, 2 sigmoid
    if gating not in (1, 2):
        raise UnsupportedModelError(f"deepseek2.expert_gating_func {gating} is neither softmax (1) nor sigmoid (2)")
    groups = int(metadata.get("deepseek2.expert_group_count") or 1)
    routing = {"expert_scoring": "sigmoid" if gating == 2 else "softmax", "expert_groups": groups,
               "expert_groups_used": int(metadata.get("deepseek2.expert_group_used_count") or groups)}  # fmt: skip
    scale, scaling = float(qk_dim) ** -0.5, None
    factor = float(metadata.get("deepseek2.rope.scaling.factor") or 1.0)
    if metadata.get("deepseek2.rope.scaling.type") == "yarn" and factor != 1.0:
        original = int(get("rope.scaling.original_context_length"))
        log_multiplier = float(metadata.get("deepseek2.rope.scaling.yarn_log_multiplier") or 0.0)
        scale *= (1.0 + log_multiplier * math.log(factor)) ** 2  # mscale(factor, mscale_all_dim)²
        scaling = RopeScaling(kind="yarn", factor=factor, original_max_position=original, attention_factor=1.0,  # mscale / mscale_all_dim
                              beta_fast=float(metadata.get("deepseek2.rope.scaling.yarn_beta_fast", 32.0)),
                              beta_slow=float(metadata.get("deepseek2.rope.scaling.yarn_beta_slow", 1.0)))  # fmt: skip
    first_dense = int(metadata.get("deepseek2.leading_dense_block_count") or 0)
    return _latent_config(
        {**common, "rope_scaling": scaling}, scale, rank, int(metadata.get("deepseek2.attention.q_lora_rank") or 0),
        qk_dim - rope_dim, rope_dim, v_dim, int(get("expert_count")), int(get("expert_used_count")),
        int(get("expert_feed_forward_length")), int(metadata.get("deepseek2.expert_shared_count") or 0),
        bool(metadata.get("deepseek2.expert_weights_norm", False)), tuple(range(first_dense, common["num_layers"])),
        float(metadata.get("deepseek2.expert_weights_scale") or 1.0), routing,
    )  # fmt: skip


def _latent_config(common: dict[str, Any], scale: float, rank: int, q_rank: int, nope: int, rope_dim: int, v_dim: int,
                   experts: int, per_token: int, width: int, shared: int, normalize: bool, layers: tuple[int, ...],
                   routed_scale: float, routing: dict[str, Any]) -> ModelConfig:  # fmt: skip
    """DeepSeek-V2's or V3's config from either format: one KV head of rope + rank channels (the
    latent and the RoPE key), RoPE over the first rope_dim, the score scale, routed experts (chosen
    by `routing`: ModelConfig's expert_scoring and groups) and `shared` ungated shared ones of
    `width` each."""
    return ModelConfig(
        architecture="deepseek_v2", rotary_dim=rope_dim, query_pre_attn_scalar=scale**-2, kv_lora_rank=rank, q_lora_rank=q_rank,
        qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim, v_head_dim=v_dim, num_experts=experts, experts_per_token=per_token,
        expert_intermediate_size=width, normalize_expert_weights=normalize, moe_layers=layers,
        shared_expert_intermediate_size=width * shared, shared_expert_gated=False, routed_scaling_factor=routed_scale, **routing,
        **{**common, "head_dim": rope_dim + rank, "num_kv_heads": 1},
    )  # fmt: skip


def rope_rows_order(gguf_name: str, config: ModelConfig) -> np.ndarray | None:
    """For a GGUF tensor: the row order of `latent_rope_order`, or None for tensors with no RoPE rows."""
    if ".attn_q." in gguf_name or ".attn_q_b." in gguf_name:
        return latent_rope_order(config, "query")
    if ".attn_kv_a_mqa." in gguf_name:
        return latent_rope_order(config, "kv_a")
    return None


def latent_rope_order(config: ModelConfig, rows: str) -> np.ndarray:
    """The row order that turns a projection's RoPE rows from DeepSeek's interleaved pairs (x0, x1),
    (x2, x3)... into the halves kvgen's rotate-half turns together (x0 with x_{d/2}): `rows`
    "query" (each head's last qk_rope_head_dim rows) or "kv_a" (its last qk_rope_head_dim)."""
    nope, rope_dim, rank = config.qk_nope_head_dim, config.qk_rope_head_dim, config.kv_lora_rank
    halves = np.concatenate([np.arange(0, rope_dim, 2), np.arange(1, rope_dim, 2)])
    if rows == "kv_a":
        return np.concatenate([np.arange(rank), rank + halves])
    heads = np.arange(config.num_heads)[:, None] * (nope + rope_dim)
    return (heads + np.concatenate([np.arange(nope), nope + halves])[None]).reshape(-1)


def prepare_deepseek_weights(tensors: dict[str, Any], config: ModelConfig, name_experts: Callable[[dict], None]) -> None:
    """In place, before any quantization: the shared experts under one MLP's names
    (mlp.shared_experts -> mlp.shared_expert), the routed experts one weight each (`name_experts`),
    and the RoPE rows of the queries and of kv_a_proj in rotate-half's order (`latent_rope_order`)."""
    for name in list(tensors):
        if _SHARED_EXPERTS.match(name):
            tensors[_SHARED_EXPERTS.sub(r"\1.shared_expert.", name)] = tensors.pop(name)
    name_experts(tensors)
    for name, tensor in list(tensors.items()):
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            tensors[name] = tensor[torch.from_numpy(latent_rope_order(config, "query"))].contiguous()
        elif name.endswith(("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias")):
            tensors[name] = tensor[torch.from_numpy(latent_rope_order(config, "kv_a"))].contiguous()

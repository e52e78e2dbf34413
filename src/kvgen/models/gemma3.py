"""Gemma 3 (text): sandwich norms, QK-norm, GeGLU, scaled embeddings, and interleaved attention:
five sliding-window layers (local RoPE base) for every global layer (global RoPE base)."""

from __future__ import annotations

import torch
from torch import nn

from kvgen.config import ModelConfig
from kvgen.kv.interface import KVCache
from kvgen.models.base import DecoderLM, RopeKey
from kvgen.models.layers import Attention, AttentionMask, GatedMLP, RMSNorm
from kvgen.models.weights import WeightSource

NORM_OFFSET = 1.0  # Gemma norms multiply by (1 + w)


class Gemma3Block(nn.Module):
    qk_norm_offset: float | None = NORM_OFFSET  # Gemma 2 has no QK-norm

    def __init__(self, config: ModelConfig, layer: int, weights: WeightSource):
        super().__init__()
        prefix = f"model.layers.{layer}"

        def norm(name: str) -> RMSNorm:
            return RMSNorm(weights.take_tensor(f"{prefix}.{name}.weight") + NORM_OFFSET, config.rms_norm_eps)

        self.input_norm = norm("input_layernorm")
        self.attn = Attention(config, layer, weights, f"{prefix}.self_attn", qk_norm_offset=self.qk_norm_offset)
        self.post_attn_norm = norm("post_attention_layernorm")
        self.pre_mlp_norm = norm("pre_feedforward_layernorm")
        self.mlp = GatedMLP(config, weights, f"{prefix}.mlp")
        self.post_mlp_norm = norm("post_feedforward_layernorm")

    def forward(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache, mask: AttentionMask
    ) -> torch.Tensor:
        h = h + self.post_attn_norm(self.attn(self.input_norm(h), rope, cache, mask))
        return h + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(h)))


class Gemma3Model(DecoderLM):
    norm_offset = NORM_OFFSET

    def __init__(self, config: ModelConfig, weights: WeightSource):
        super().__init__(config, weights)
        self.embed_scale = config.hidden_size**0.5

    def build_block(self, config: ModelConfig, layer: int, weights: WeightSource) -> nn.Module:
        return Gemma3Block(config, layer, weights)

    def rope_key(self, layer: int) -> RopeKey:
        if self.config.layer_types[layer] == "sliding":
            return self.config.rope_local_theta or self.config.rope_theta, None
        return self.config.rope_theta, self.config.rope_scaling

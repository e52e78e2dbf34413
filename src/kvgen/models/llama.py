"""Llama family: Llama 2/3, SmolLM2/3, Mistral, Qwen2 (QKV bias), Granite (scaled residuals), Mixtral
(experts). Pre-norm blocks, SwiGLU MLP or a mixture of SwiGLU experts."""

from __future__ import annotations

import torch
from torch import nn

from kvgen.config import ModelConfig
from kvgen.kv.interface import KVCache
from kvgen.models.base import DecoderLM
from kvgen.models.layers import Attention, AttentionMask, GatedMLP, RMSNorm
from kvgen.models.moe import SparseMoE
from kvgen.models.weights import WeightSource


class LlamaBlock(nn.Module):
    qk_norm_offset: float | None = None  # Qwen3 adds per-head q/k RMSNorm (weights used as is)

    def __init__(self, config: ModelConfig, layer: int, weights: WeightSource):
        super().__init__()
        prefix = f"model.layers.{layer}"
        eps = config.rms_norm_eps
        self.input_norm = RMSNorm(weights.take_tensor(f"{prefix}.input_layernorm.weight"), eps)
        self.attn = self.build_attention(config, layer, weights, f"{prefix}.self_attn")
        self.post_attn_norm = RMSNorm(weights.take_tensor(f"{prefix}.post_attention_layernorm.weight"), eps)
        self.residual_multiplier = config.residual_multiplier
        self.mlp = (SparseMoE(config, weights, f"{prefix}.mlp") if layer in config.moe_layers
                    else GatedMLP(config, weights, f"{prefix}.mlp"))  # fmt: skip

    def build_attention(self, config: ModelConfig, layer: int, weights: WeightSource, prefix: str) -> nn.Module:
        return Attention(config, layer, weights, prefix, qk_norm_offset=self.qk_norm_offset)

    def forward(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache, mask: AttentionMask
    ) -> torch.Tensor:
        if self.residual_multiplier != 1.0:  # Granite scales each sublayer's output before adding it
            h = h + self.attn(self.input_norm(h), rope, cache, mask) * self.residual_multiplier
            return h + self.mlp(self.post_attn_norm(h)) * self.residual_multiplier
        h = h + self.attn(self.input_norm(h), rope, cache, mask)
        return h + self.mlp(self.post_attn_norm(h))


class LlamaModel(DecoderLM):
    def build_block(self, config: ModelConfig, layer: int, weights: WeightSource) -> nn.Module:
        return LlamaBlock(config, layer, weights)

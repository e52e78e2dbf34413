"""OLMo 2 (AllenAI): Llama's attention and SwiGLU MLP in blocks normed after each sublayer instead of
before it (h + norm(attn(h)), then h + norm(mlp(h))), with one RMSNorm over all of a token's query
heads together and one over its key heads before RoPE. The C steps run it as Gemma's sandwich
blocks without their input norms, the QK-norm taken over the whole projection (block_t's
qk_norm_full)."""

from __future__ import annotations

import torch
from torch import nn

from kvgen.config import ModelConfig
from kvgen.kv.interface import KVCache
from kvgen.models.base import DecoderLM
from kvgen.models.layers import Attention, AttentionMask, GatedMLP, RMSNorm
from kvgen.models.weights import WeightSource


class Olmo2Block(nn.Module):
    # The names FastDecoder reads for sandwich blocks (Gemma's): no norm before either sublayer.
    input_norm = None
    pre_mlp_norm = None

    def __init__(self, config: ModelConfig, layer: int, weights: WeightSource):
        super().__init__()
        prefix, eps = f"model.layers.{layer}", config.rms_norm_eps
        self.attn = Attention(config, layer, weights, f"{prefix}.self_attn", qk_norm_offset=0.0)  # norms over all heads
        self.post_attn_norm = RMSNorm(weights.take_tensor(f"{prefix}.post_attention_layernorm.weight"), eps)
        self.mlp = GatedMLP(config, weights, f"{prefix}.mlp")
        self.post_mlp_norm = RMSNorm(weights.take_tensor(f"{prefix}.post_feedforward_layernorm.weight"), eps)

    def forward(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache, mask: AttentionMask
    ) -> torch.Tensor:
        h = h + self.post_attn_norm(self.attn(h, rope, cache, mask))
        return h + self.post_mlp_norm(self.mlp(h))


class Olmo2Model(DecoderLM):
    def build_block(self, config: ModelConfig, layer: int, weights: WeightSource) -> nn.Module:
        return Olmo2Block(config, layer, weights)

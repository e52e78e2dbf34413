"""Qwen3 (dense and MoE): Llama blocks with an RMSNorm over each head's query and key before RoPE,
and no QKV bias; head_dim is set by the config (not hidden / heads). Qwen3-MoE's sparse layers
take a mixture of experts for the MLP (LlamaBlock builds it from the config's moe_layers). OLMoE
runs these blocks too: its QK-norm weights span all heads, so Attention norms all heads at once."""

from __future__ import annotations

from torch import nn

from kvgen.config import ModelConfig
from kvgen.models.base import DecoderLM
from kvgen.models.llama import LlamaBlock
from kvgen.models.weights import WeightSource


class Qwen3Block(LlamaBlock):
    qk_norm_offset = 0.0  # Qwen3's q_norm / k_norm multiply by w, not (1 + w)


class Qwen3Model(DecoderLM):
    def build_block(self, config: ModelConfig, layer: int, weights: WeightSource) -> nn.Module:
        return Qwen3Block(config, layer, weights)

"""DeepSeek-V2 (V2-Lite, V2): Llama-shaped blocks whose attention is multi-head latent attention
(models/mla.py) and whose MLP, past the first `first_k_dense_replace` layers, is a mixture of
routed experts (weights scaled by routed_scaling_factor) plus ungated shared experts (models/moe.py)."""

from __future__ import annotations

from torch import nn

from kvgen.config import ModelConfig
from kvgen.models.llama import LlamaBlock, LlamaModel
from kvgen.models.mla import LatentAttention
from kvgen.models.weights import WeightSource


class DeepseekBlock(LlamaBlock):
    def build_attention(self, config: ModelConfig, layer: int, weights: WeightSource, prefix: str) -> nn.Module:
        return LatentAttention(config, layer, weights, prefix)


class DeepseekModel(LlamaModel):
    def build_block(self, config: ModelConfig, layer: int, weights: WeightSource) -> nn.Module:
        return DeepseekBlock(config, layer, weights)

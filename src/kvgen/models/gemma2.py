"""Gemma 2: Gemma 3's sandwich blocks without QK-norm, sliding and global layers alternating
(one RoPE base for both), attention scores soft-capped (cap * tanh(s / cap)) and the final logits
too (the C steps soft-cap the scores as they fold them into the softmax: attention_tiles.c)."""

from __future__ import annotations

from torch import nn

from kvgen.config import ModelConfig
from kvgen.models.gemma3 import Gemma3Block, Gemma3Model
from kvgen.models.weights import WeightSource


class Gemma2Block(Gemma3Block):
    qk_norm_offset = None


class Gemma2Model(Gemma3Model):
    """Gemma 3's embedding scale and norms; no local RoPE base in its config, so one rotary table."""

    def build_block(self, config: ModelConfig, layer: int, weights: WeightSource) -> nn.Module:
        return Gemma2Block(config, layer, weights)

"""Gemma 2: Gemma 3's sandwich blocks without QK-norm, sliding and global layers alternating
(one RoPE base for both), attention scores soft-capped (cap * tanh(s / cap)) and the final logits
too. The C decode path has no soft-capping, so Gemma 2 always decodes on the torch path."""

from __future__ import annotations

from torch import nn

from kvgen.config import ModelConfig
from kvgen.models.base import DecoderLM
from kvgen.models.gemma3 import NORM_OFFSET, Gemma3Block
from kvgen.models.weights import WeightSource


class Gemma2Block(Gemma3Block):
    qk_norm_offset = None


class Gemma2Model(DecoderLM):
    norm_offset = NORM_OFFSET

    def __init__(self, config: ModelConfig, weights: WeightSource):
        super().__init__(config, weights)
        self.embed_scale = config.hidden_size**0.5

    def build_block(self, config: ModelConfig, layer: int, weights: WeightSource) -> nn.Module:
        return Gemma2Block(config, layer, weights)

"""Phi-3 / Phi-4-mini: Llama-shaped pre-norm blocks whose checkpoints store QKV and gate/up fused
(the layers take them as one matmul each), LongRoPE scaling (short / long factors, models/rotary.py)
and, for Phi-4-mini, RoPE over only part of each head."""

from __future__ import annotations

import torch
from torch import nn

from kvgen.config import ModelConfig
from kvgen.models.base import DecoderLM
from kvgen.models.llama import LlamaBlock
from kvgen.models.weights import WeightSource


class Phi3Model(DecoderLM):
    def build_block(self, config: ModelConfig, layer: int, weights: WeightSource) -> nn.Module:
        return LlamaBlock(config, layer, weights)

    def rerotate(self, layer: int, keys: torch.Tensor, delta: int) -> torch.Tensor:
        scaling = self.config.rope_scaling
        if scaling is not None and scaling.kind == "longrope":
            # cos/sin carry the attention factor and the factors switch with length: no exact shift.
            raise ValueError("this Phi-3 model uses LongRoPE, whose keys cannot be moved to new positions; "
                             "drop context shift (remove_range) or use a model without LongRoPE")
        return super().rerotate(layer, keys, delta)

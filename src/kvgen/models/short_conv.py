"""LFM2's gated short convolution (HF Lfm2ShortConv): in_proj -> B, C, x; B x through a causal
depthwise conv of a few taps (3 in Liquid's models), no activation; C times that; out_proj.

The layer's state is its conv window, the last `conv_kernel` inputs of the conv [1, hidden, K]
(as Mamba's conv state); the recurrent state is empty ([1, 0]), so the hybrid's cache and prefix
snapshots hold these layers beside Mamba-2's without a second kind of state.
"""

from __future__ import annotations

import torch
from torch import nn

from kvgen.config import ShortConvConfig
from kvgen.errors import ModelLoadError
from kvgen.models.lora import LoraStacks, with_delta
from kvgen.models.recurrent import Captured, causal_conv, conv_state_after
from kvgen.models.weights import WeightSource, frozen, linear


class ShortConvMixer(nn.Module):
    lora: LoraStacks | None = None  # set with `layer` while adapters are loaded (in_proj, out_proj)
    layer: int = -1

    def __init__(self, config: ShortConvConfig, weights: WeightSource, prefix: str):
        super().__init__()
        self.hidden, self.kernel = config.hidden_size, config.conv_kernel

        def optional(name: str) -> torch.Tensor | None:
            return weights.take_tensor(name) if weights.has(name) else None

        self.in_proj = linear(weights.take(f"{prefix}.in_proj.weight"), optional(f"{prefix}.in_proj.bias"))  # [3 H, H]: B, C, x
        self.conv_weight = frozen(weights.take_tensor(f"{prefix}.conv.weight").float().reshape(self.hidden, 1, -1))  # [H, 1, K]
        if self.conv_weight.shape[2] != self.kernel:
            raise ModelLoadError(f"{prefix}.conv.weight has {self.conv_weight.shape[2]} taps, the config says conv_L_cache = {self.kernel}")
        bias = optional(f"{prefix}.conv.bias")
        self.conv_bias = frozen(bias.float().reshape(-1)) if bias is not None else None
        self.out_proj = linear(weights.take(f"{prefix}.out_proj.weight"), optional(f"{prefix}.out_proj.bias"))

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor, capture: list[list[int]]) -> tuple[torch.Tensor, Captured]:
        """x [B, S, H], the rows' conv windows [B, H, K] (and their empty states [B, 0]) -> output
        [B, S, H] and, per row, the (conv window, empty state) after each position in capture[row]."""
        projected = with_delta(self.lora, self.layer, "mixer_in", x, self.in_proj(x))
        B, C, inputs = projected.float().transpose(1, 2).chunk(3, dim=1)  # [B, H, S] each
        conv, extended = causal_conv(conv_state.float(), B * inputs, self.conv_weight, self.conv_bias, silu=False)
        y = (C * conv).transpose(1, 2)
        captured = [[(conv_state_after(extended, row, p, self.kernel), state[row : row + 1].clone()) for p in points]
                    for row, points in enumerate(capture)]  # fmt: skip
        y = y.to(x.dtype).contiguous()
        return with_delta(self.lora, self.layer, "mixer_out", y, self.out_proj(y)), captured

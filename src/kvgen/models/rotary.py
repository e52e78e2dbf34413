"""Rotary position embeddings (rotate-half layout, as Hugging Face checkpoints expect)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvgen.config import RopeScaling
from kvgen.kernels import load

from kvgen.kv.rotation import rotate_half  # one definition, shared with the caches that turn pre-RoPE keys


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    # Same expression as transformers so frequencies match bit for bit.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "longrope":
        return _longrope_frequencies(head_dim, theta, scaling.short_factor)
    if scaling.kind == "yarn":
        return _yarn_frequencies(head_dim, theta, scaling)
    return _llama3_frequencies(inv_freq, scaling)


def _longrope_frequencies(head_dim: int, theta: float, factors: tuple[float, ...]) -> torch.Tensor:
    if len(factors) != head_dim // 2:
        raise ValueError(f"longrope needs {head_dim // 2} factors (rotary dim / 2), got {len(factors)}")
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**shape)  # same expression as transformers


def _llama3_frequencies(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    low_freq_wavelen = s.original_max_position / s.low_freq_factor
    high_freq_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_frequencies(head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: the fastest dimensions (more than beta_fast turns over the original context) keep their
    frequency, the slowest (fewer than beta_slow) are divided by `factor`, a linear ramp blends the
    ones between. The same expressions as transformers, so the frequencies match bit for bit."""

    def dimension_of(turns: float) -> float:  # the dimension that turns `turns` times over the context
        return (head_dim * math.log(s.original_max_position / (turns * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dimension_of(s.beta_fast), dimension_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width: a step
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # the share of each dimension's original frequency
    return (1.0 / (s.factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept


class RotaryEmbedding(nn.Module):
    """cos/sin of each position's angles, times `attention_factor` (YaRN's temperature: 1 for the
    other kinds, where the product is skipped)."""

    def __init__(self, inv_freq: torch.Tensor, attention_factor: float = 1.0):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_factor = attention_factor

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, S] -> cos, sin [B, 1, S, D], computed in fp32 like the reference."""
        cos, sin = self.turns(positions)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]

    def turns(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos, sin [B, S, D] of the bare rotation (no attention factor): what moving a cached
        key by some positions applies."""
        freqs = positions.float()[..., None] * self.inv_freq  # [B, S, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [B, S, D]
        return angles.cos(), angles.sin()


class LongRopeEmbedding(RotaryEmbedding):
    """Phi-3 LongRoPE: short factors while every position fits the pretraining context, long
    factors for a whole forward once one position is past it (transformers and vLLM decide per
    call the same way); cos/sin scaled by the attention factor. Keys cached before the switch keep
    their short-factor rotation, as in both references."""

    def __init__(self, rotary_dim: int, theta: float, scaling: RopeScaling):
        super().__init__(_longrope_frequencies(rotary_dim, theta, scaling.short_factor), scaling.attention_factor)
        self.register_buffer("long_inv_freq", _longrope_frequencies(rotary_dim, theta, scaling.long_factor), persistent=False)
        self.original_max_position = scaling.original_max_position

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        long = positions.numel() > 0 and int(positions.max()) + 1 > self.original_max_position
        inv_freq = self.long_inv_freq if long else self.inv_freq
        freqs = positions.float()[..., None] * inv_freq  # [B, S, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [B, S, D]
        cos, sin = angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def c_rows_take(*tensors: torch.Tensor) -> bool:
    """Whether kvgen's C row ops can take these tensors: float32 in host memory (a float32 model on a
    GPU takes the torch ops), and no autograd to see the op (the C row ops have no backward: KV-quant
    calibration takes gradients through the torch path)."""
    if not all(t.is_cpu and t.dtype == torch.float32 for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, D] rotated by its positions' angles; cos/sin narrower than D (partial rotary)
    turn only the first channels."""
    rotary = cos.shape[-1]
    if c_rows_take(x, cos, sin) and rotary == x.shape[-1] and x.stride(-1) == 1 and (library := load()) is not None:
        return _rope_in_c(library, x, cos, sin)
    if rotary < x.shape[-1]:
        turned, kept = x[..., :rotary], x[..., rotary:]
        return torch.cat((turned * cos + rotate_half(turned) * sin, kept), dim=-1)
    return x * cos + rotate_half(x) * sin


def _rope_in_c(library: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in one pass over x's strided view, with the same roundings."""
    batch, heads, seq, dim = x.shape
    cos, sin = cos.expand(-1, 1, seq, dim).contiguous(), sin.expand(-1, 1, seq, dim).contiguous()
    out = torch.empty(batch, heads, seq, dim)
    cos_batch_stride = 0 if cos.shape[0] == 1 else seq * dim
    library.kvgen_rope(x.data_ptr(), batch, heads, seq, dim, x.stride(0), x.stride(1), x.stride(2), cos.data_ptr(),
                       sin.data_ptr(), cos_batch_stride, out.data_ptr())  # fmt: skip
    return out

"""RoPE's rotation as the caches need it: keys stored before RoPE are turned to their positions when
read and back when stored (exact up to rounding: RoPE angles add and negate). models/rotary.py
builds the tables and applies RoPE in the forward pass with the same `rotate_half`."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def turn(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """keys [..., N, D] turned by RoPE at cos/sin [N, R] (inverse: turned back to before RoPE); R < D
    (partial rotary) turns the first R channels and keeps the rest."""
    rotary = cos.shape[-1]
    if rotary < keys.shape[-1]:
        return torch.cat((turn(keys[..., :rotary], cos, sin, inverse), keys[..., rotary:]), dim=-1)
    return keys * cos - rotate_half(keys) * sin if inverse else keys * cos + rotate_half(keys) * sin

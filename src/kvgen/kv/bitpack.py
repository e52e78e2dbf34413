"""Bit packing of small integer codes into uint8 storage: 8 codes of `bits` bits share `bits` bytes.

Codes travel as one little-endian word per 8 codes (code i at bit bits*i), so 4-bit codes are two
per byte and 3-bit codes 8 per 3 bytes, with no padding inside a head vector (head_dim % 8 == 0).
"""

from __future__ import annotations

import torch

_SHIFTS: dict[int, torch.Tensor] = {}


def _shifts(step: int, count: int) -> torch.Tensor:
    key = step * 100 + count
    if key not in _SHIFTS:
        _SHIFTS[key] = torch.arange(count, dtype=torch.int32) * step
    return _SHIFTS[key]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., N] integers in [0, 2**bits) -> uint8 [..., N * bits / 8]."""
    if bits == 8:
        return codes.to(torch.uint8)
    if bits == 4:  # low nibble first, as the word layout below would give
        pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2)
        return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
    if codes.shape[-1] % 8:
        raise ValueError(f"cannot pack {codes.shape[-1]} codes per vector: need a multiple of 8")
    groups = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, 8)  # [..., N/8, 8]
    words = (groups << _shifts(bits, 8)).sum(-1, dtype=torch.int32)  # [..., N/8]
    packed = (words[..., None] >> _shifts(8, bits)) & 0xFF  # [..., N/8, bits]
    return packed.to(torch.uint8).reshape(*codes.shape[:-1], -1)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., N * bits / 8] -> codes [..., N] (int32; uint8 for 4 bits: two nibbles, no word math)."""
    if bits == 8:
        return packed.to(torch.int32)
    if bits == 4:
        return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)
    groups = packed.to(torch.int32).reshape(*packed.shape[:-1], -1, bits)  # [..., N/8, bits]
    words = (groups << _shifts(8, bits)).sum(-1, dtype=torch.int32)  # [..., N/8]
    codes = (words[..., None] >> _shifts(bits, 8)) & ((1 << bits) - 1)  # [..., N/8, 8]
    return codes.reshape(*packed.shape[:-1], -1)

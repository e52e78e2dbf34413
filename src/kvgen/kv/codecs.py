"""K/V storage codecs: how a cached key or value is rounded, and what it costs in bits.

Each codec rounds a block of cached vectors [H, S, D] exactly as its storage would (quantize, then
dequantize). Per-token codecs round each position on its own; KIVI's key codec rounds each channel
over a group of tokens (keys have outlier channels, values do not), so it waits for a full group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

FP8_MAX = 448.0  # largest finite float8 e4m3fn


@dataclass(frozen=True)
class Codec:
    name: str
    bits_per_value: float  # storage, including amortized scales (fp16 scale/offset per group)
    round: Callable[[torch.Tensor], torch.Tensor]  # [H, S, D] -> same shape, as stored
    group_tokens: int = 1  # positions rounded together (1 = each position alone)


def _cast(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: x.to(dtype).to(x.dtype)


def _fp8(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # per position
    return (x / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale


def _int8(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(x / scale).clamp(-127, 127) * scale


def _asymmetric(x: torch.Tensor, bits: int, dim: int, group: int) -> torch.Tensor:
    """Min/max rounding to 2**bits levels over groups of `group` elements along `dim`."""
    moved = x.movedim(dim, -1)
    shape = moved.shape
    grouped = moved.reshape(*shape[:-1], shape[-1] // group, group)
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    step = ((high - low) / (2**bits - 1)).clamp(min=1e-12)
    rounded = torch.round((grouped - low) / step) * step + low
    return rounded.reshape(shape).movedim(-1, dim)


KIVI_GROUP = 32
CODECS: dict[str, Codec] = {
    "fp32": Codec("fp32", 32, lambda x: x),
    "fp16": Codec("fp16", 16, _cast(torch.float16)),
    "bf16": Codec("bf16", 16, _cast(torch.bfloat16)),
    "fp8": Codec("fp8", 8 + 16 / 64, _fp8),
    "int8": Codec("int8", 8 + 16 / 64, _int8),
    # KIVI 4-bit: values per token in groups of 32 channels...
    "int4": Codec("int4", 4 + 32 / KIVI_GROUP, lambda x: _asymmetric(x, 4, dim=-1, group=KIVI_GROUP)),
    # ...keys per channel over groups of 32 tokens.
    "int4-kivi-keys": Codec("int4", 4 + 32 / KIVI_GROUP, lambda x: _asymmetric(x, 4, dim=1, group=KIVI_GROUP), KIVI_GROUP),
    "int3": Codec("int3", 3 + 32 / KIVI_GROUP, lambda x: _asymmetric(x, 3, dim=-1, group=KIVI_GROUP)),
}
KV_DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8", "int4", "int3")


def key_codec(name: str) -> Codec:
    """int4 keys follow KIVI (per channel over tokens); everything else is per position."""
    return CODECS["int4-kivi-keys"] if name == "int4" else value_codec(name)


def value_codec(name: str) -> Codec:
    if name not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {name!r}; choose one of {', '.join(KV_DTYPES)}")
    return CODECS[name]

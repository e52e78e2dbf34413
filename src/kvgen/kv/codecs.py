"""K/V storage codecs: how a block of cached vectors is packed into bytes, and read back.

A codec encodes whole blocks of BLOCK_TOKENS positions: `encode(x [H, N, B, D], layer)` returns the
tensors that are really stored (codes bit-packed into uint8, fp8, int8, fp16/bf16, plus scales and
offsets), each [H, N, ...]; `decode(parts, layer)` gives fp32 [H, N, B, D] back. Per-token codecs
round each position on its own; KIVI's key codec rounds each channel over the block (keys have
outlier channels, values do not). KVQuant's 3-bit codecs live in kv/kvquant.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvgen.kv.bitpack import pack, unpack

FP8_MAX = 448.0  # largest finite float8 e4m3fn
BLOCK_TOKENS = 32  # positions packed together (also KIVI's key group)
CHANNEL_GROUP = 32  # channels sharing one scale/offset in the per-token integer codecs
MIN_STEP = 1e-6  # scales below this would underflow fp16

Parts = dict[str, torch.Tensor]


class Codec(ABC):
    name: str
    keys_before_rope: bool = False  # encode() wants keys as they were before RoPE
    sink_tokens: int = 0  # leading positions this codec wants kept in full precision
    # Each position is encoded on its own (its parts have the block's positions on dim 2), so stored
    # positions can be moved between blocks as codes; False where a block's positions share scales.
    per_position: bool = True
    # encode/decode ignore `layer` (kvquant3's codebooks are per layer): all layers can go at once.
    same_for_every_layer: bool = True

    @property
    def format_name(self) -> str:
        """The stored format's name (a paged pool's format_key): the name, unless the layout differs."""
        return self.name

    @abstractmethod
    def encode(self, x: torch.Tensor, layer: int) -> Parts:
        """x [H, N, B, D] fp32 -> stored tensors, each [H, N, ...]."""

    @abstractmethod
    def decode(self, parts: Parts, layer: int) -> torch.Tensor:
        """Stored tensors [H, N, ...] -> fp32 [H, N, B, D]."""

    def to_rows(self, parts: Parts) -> Parts:
        """Stored tensors [..., N, ...] -> the same with each block's positions as rows [..., N, B, ...]
        (per-position codecs whose layout interleaves positions override this and from_rows)."""
        return parts

    def from_rows(self, parts: Parts) -> Parts:
        """The inverse of to_rows."""
        return parts

    def round(self, x: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """x [H, S, D] -> as stored and read back, in blocks of BLOCK_TOKENS (one block of S when S
        is not a multiple: per-position codecs round the same either way)."""
        heads, seq, dim = x.shape
        block = BLOCK_TOKENS if seq % BLOCK_TOKENS == 0 else seq
        blocks = x.reshape(heads, seq // block, block, dim)
        return self.decode(self.encode(blocks, layer), layer).reshape(heads, seq, dim)


class CastCodec(Codec):
    """fp32 / fp16 / bf16: the values themselves in a narrower float."""

    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype

    def encode(self, x: torch.Tensor, layer: int) -> Parts:
        return {"x": x.to(self.dtype)}

    def decode(self, parts: Parts, layer: int) -> torch.Tensor:
        return parts["x"].float()


def _fp16_scale(x: torch.Tensor) -> torch.Tensor:
    """A positive fp16 scale; codes are computed with the rounded scale so they match what is stored."""
    return x.clamp(min=MIN_STEP).to(torch.float16)


class Fp8Codec(Codec):
    """float8 e4m3 with one fp16 scale per position."""

    name = "fp8"

    def encode(self, x: torch.Tensor, layer: int) -> Parts:
        scale = _fp16_scale(x.abs().amax(-1, keepdim=True) / FP8_MAX)  # [H, N, B, 1]
        return {"codes": (x / scale.float()).to(torch.float8_e4m3fn), "scale": scale}

    def decode(self, parts: Parts, layer: int) -> torch.Tensor:
        return parts["codes"].float() * parts["scale"].float()


class Int8Codec(Codec):
    """Symmetric int8 with one fp16 scale per position."""

    name = "int8"

    def encode(self, x: torch.Tensor, layer: int) -> Parts:
        scale = _fp16_scale(x.abs().amax(-1, keepdim=True) / 127)  # [H, N, B, 1]
        return {"codes": torch.round(x / scale.float()).clamp(-127, 127).to(torch.int8), "scale": scale}

    def decode(self, parts: Parts, layer: int) -> torch.Tensor:
        return parts["codes"].float() * parts["scale"].float()


def key_group(block_tokens: int) -> int:
    """Keys per interleaved group of Int8KeyCodec: 16, or the largest power of two dividing a block."""
    return min(block_tokens & -block_tokens, 16)


class Int8KeyCodec(Int8Codec):
    """int8 keys, as Int8Codec, stored so that the attention kernels score 16 keys per instruction
    with no transpose: a block's codes are [B / G, D / 4, G, 4], groups of G = key_group(B) keys
    (16 in 32-position blocks), within a group channel quad by channel quad, each key's 4 bytes of
    that quad side by side (one 64-byte row per quad, the dwords a vpdpbusd reads). The layout is
    the same on every machine (caches move between machines and to disk)."""

    @property
    def format_name(self) -> str:
        return "int8t"  # not Int8Codec's row layout: blocks of one never import into the other

    def encode(self, x: torch.Tensor, layer: int) -> Parts:
        if x.shape[-1] % 4:
            raise ValueError(f"int8 keys are stored in channel quads: head size {x.shape[-1]} is not a multiple of 4")
        parts = super().encode(x, layer)
        return self.from_rows(parts)

    def decode(self, parts: Parts, layer: int) -> torch.Tensor:
        return super().decode(self.to_rows(parts), layer)

    def to_rows(self, parts: Parts) -> Parts:
        codes = parts["codes"]  # [..., B / G, D / 4, G, 4]
        groups, quads, group = codes.shape[-4:-1]
        rows = codes.transpose(-3, -2).reshape(*codes.shape[:-4], groups * group, quads * 4)
        return {**parts, "codes": rows}

    def from_rows(self, parts: Parts) -> Parts:
        rows = parts["codes"]  # [..., B, D]
        tokens, dim = rows.shape[-2:]
        group = key_group(tokens)
        codes = rows.reshape(*rows.shape[:-2], tokens // group, group, dim // 4, 4).transpose(-3, -2).contiguous()
        return {**parts, "codes": codes}


def min_max_encode(x: torch.Tensor, bits: int) -> Parts:
    """Asymmetric rounding to 2**bits levels over the last dim of x [..., G]: codes, fp16 step and low."""
    low = x.amin(-1, keepdim=True).to(torch.float16)
    step = _fp16_scale((x.amax(-1, keepdim=True) - low.float()) / (2**bits - 1))
    codes = torch.round((x - low.float()) / step.float()).clamp(0, 2**bits - 1)
    return {"codes": codes, "step": step, "low": low}


class PerTokenIntCodec(Codec):
    """Min/max integer codes per position, one fp16 step and offset per CHANNEL_GROUP channels
    (KIVI's value codec at 4 bits; the plain uniform baseline at 3)."""

    def __init__(self, name: str, bits: int):
        self.name, self.bits = name, bits

    def encode(self, x: torch.Tensor, layer: int) -> Parts:
        heads, blocks, tokens, dim = x.shape
        grouped = x.reshape(heads, blocks, tokens, dim // CHANNEL_GROUP, CHANNEL_GROUP)
        parts = min_max_encode(grouped, self.bits)
        parts["codes"] = pack(parts["codes"].reshape(heads, blocks, tokens, dim), self.bits)
        return parts

    def decode(self, parts: Parts, layer: int) -> torch.Tensor:
        step, low = parts["step"], parts["low"]  # [H, N, B, D/G, 1]
        codes = unpack(parts["codes"], self.bits).reshape(*step.shape[:-1], CHANNEL_GROUP)
        return (codes * step.float() + low.float()).flatten(-2)


class KiviKeyCodec(Codec):
    """KIVI keys: int4 per channel over the block's positions (fp16 step and offset per channel)."""

    name = "int4"
    per_position = False

    def encode(self, x: torch.Tensor, layer: int) -> Parts:
        parts = min_max_encode(x.transpose(-1, -2), 4)  # per channel: [H, N, D, B]
        parts["codes"] = pack(parts["codes"].transpose(-1, -2), 4)  # [H, N, B, D/2]
        return parts

    def decode(self, parts: Parts, layer: int) -> torch.Tensor:
        codes = unpack(parts["codes"], 4)  # [H, N, B, D]
        return codes * parts["step"].float().transpose(-1, -2) + parts["low"].float().transpose(-1, -2)


CODECS: dict[str, Codec] = {
    "fp32": CastCodec("fp32", torch.float32),
    "fp16": CastCodec("fp16", torch.float16),
    "bf16": CastCodec("bf16", torch.bfloat16),
    "fp8": Fp8Codec(),
    "int8": Int8Codec(),
    "int4": PerTokenIntCodec("int4", 4),
    "int4-kivi-keys": KiviKeyCodec(),
    "int8-keys": Int8KeyCodec(),
    "int3": PerTokenIntCodec("int3", 3),
}
# kvquant3 needs the model (calibrated codebooks, RoPE): kv/kvquant.py builds its codecs.
KV_DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8", "int4", "int3", "kvquant3")
MODEL_CALIBRATED = ("kvquant3",)


def check_dtype(name: str) -> None:
    if name not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {name!r}; choose one of {', '.join(KV_DTYPES)}")


def key_codec(name: str) -> Codec:
    """int4 keys follow KIVI (per channel over a block); int8 keys are stored interleaved for the
    kernels (Int8KeyCodec); everything else is per position, as values."""
    special = {"int4": "int4-kivi-keys", "int8": "int8-keys"}
    return CODECS[special[name]] if name in special else value_codec(name)


def value_codec(name: str) -> Codec:
    check_dtype(name)
    if name in MODEL_CALIBRATED:
        raise ValueError(f"KV dtype {name!r} is calibrated on a model: build it with kv.kvquant.codecs_for(model, ...)")
    return CODECS[name]

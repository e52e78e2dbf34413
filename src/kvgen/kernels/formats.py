"""Weight formats of the quantized matmul kernels, and conversions into them.

Each block holds 32 consecutive weights of a row, matching the structs in qgemm.c:

  q4:  f32 d, f32 m, 4-bit q in [0, 15] (w = d * q + m); byte j = element j (low nibble)
       and j + 16 (high)                                                      -> 24 bytes per block
  q4h: the same with f16 d and m: GGUF's Q4_1 block, byte for byte            -> 20 bytes per block
  q8:  f32 d, f32 m, int8 q (w = d * q + m)                                   -> 40 bytes per block
  q8s: f16 d, int8 q (w = d * q): GGUF's Q8_0 block, byte for byte            -> 34 bytes per block
  q5:  f16 d, 5-bit u (w = d * (u - 16)): GGUF's Q5_0 block, byte for byte    -> 22 bytes per block
  q4k: GGUF's Q4_K super-block of 256 weights, byte for byte: f16 d and dmin, 6-bit scale sc and
       min mn per 32 weights, 4-bit q (w = d * sc * q - dmin * mn)            -> 144 bytes per 8 blocks
  q6k: GGUF's Q6_K super-block of 256 weights, byte for byte: 6-bit u, an int8 scale sc per 16
       weights, f16 d (w = d * sc * (u - 32))                                  -> 210 bytes per 8 blocks
  iq4: f32 d, 4-bit indices into IQ4_LEVELS (w = d * level), packed as q4's  -> 20 bytes per block
  mx4: iq4's layout with MXFP4_LEVELS (e2m1 doubled) and d a power of two   -> 20 bytes per block
  q5m: f32 d, f32 m, 5-bit u in [0, 31] (w = d * u + m): fifth bits, then nibbles as q5's -> 28 bytes

GGUF's Q4_1 maps onto q4h exactly (Q4_0 too: its offset -8 d is an f16 as well), Q8_0 onto q8s,
Q5_0 onto q5, Q4_K onto q4k, Q6_K onto q6k, Q3_K onto q6k too (its f16 d, its 6-bit scales less 32
as the int8 scales, its integers q in [-4, 3] as u = q + 32); Q5_1 and Q5_K onto q5m (Q5_K's d * sc and dmin * mn per
32 weights are exact as f32), or onto q8 (same integers, same scales); IQ4_NL and IQ4_XS onto iq4
(the same indices, the scales as f32: IQ4_XS's d * (ls - 32) is exact there), or onto q8s / q8 with
the levels as int8; MXFP4 onto mx4 (its codes, the scale 2^(e - 128) as f32), or onto q8s / q8.
Other sources (Q2_K: a scale and an offset per 16 weights; float weights) are requantized per
block, which is lossy. Fused weights whose parts differ meet in q8s (q5 + q8s) or q8 (anything with offsets), both
exact for every part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

QK = 32
QK_K = 256  # weights per K-quant super-block
Kind = Literal["q4", "q4h", "q8", "q8s", "q5", "q4k", "q6k", "iq4", "q5m", "mx4"]
# Row-major bytes per 32 weights (the K-quants: per 256, their GGUF super-block, SUPER_BLOCK_BYTES).
BLOCK_BYTES: dict[str, int] = {"q4": 8 + QK // 2, "q4h": 4 + QK // 2, "q8": 8 + QK, "q8s": 2 + QK, "q5": 2 + 4 + QK // 2,
                               "iq4": 4 + QK // 2, "q5m": 8 + 4 + QK // 2, "mx4": 4 + QK // 2}  # fmt: skip
SUPER_BLOCK_BYTES: dict[str, int] = {"q4k": 144, "q6k": 210}
# The kernels' interleaved layout (kernels/interleaved.c, k_quants.c): bytes per 8 rows x 32
# weights; q4kx8 unpacks the 6-bit scales and mins to a byte each (1,184 bytes per 8 rows x 256).
X8_GROUP_BYTES: dict[str, int] = {kind: 8 * size for kind, size in BLOCK_BYTES.items()} | {"q4k": 1184 // 8, "q6k": 210}
# GGUF types whose integers carry over unchanged, and the format they carry over to.
EXACT_SOURCES: dict[str, Kind] = {"Q4_0": "q4h", "Q4_1": "q4h", "Q8_0": "q8s", "Q5_0": "q5", "Q5_1": "q5m", "Q4_K": "q4k",
                                  "Q3_K": "q6k", "Q5_K": "q5m", "Q6_K": "q6k", "IQ4_NL": "iq4", "IQ4_XS": "iq4",
                                  "MXFP4": "mx4"}  # fmt: skip
# MXFP4's 16 e2m1 levels doubled (llama.cpp's kvalues_mxfp4, MXFP4_LEVELS in interleaved.c): integers,
# so a block is also an exact 8-bit block whose scale is its power of two halved.
MXFP4_LEVELS = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
# IQ4_NL and IQ4_XS's 16 non-uniform levels (llama.cpp's kvalues_iq4nl, IQ4_LEVELS in interleaved.c).
# They are int8 values, so a block is also an exact 8-bit block with the same scale.
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
Q3K_BYTES = 110  # per 256 weights: 32 bytes of high bits, 64 of low bit pairs, 12 of 6-bit scales, f16 d
IQ4_XS_BYTES = 136  # per 256 weights: f16 d, 16 bits of high scale bits, 4 bytes of low ones, 128 of nibbles
# The smallest f16 with full precision and the largest: q8s scales outside [F16_TINY, F16_MAX] are
# not made by requantize (they would lose bits); such weights stay q8.
F16_TINY, F16_MAX = 2.0**-14, 65504.0


@dataclass
class QuantizedWeight:
    kind: Kind
    blocks: torch.Tensor  # uint8 [out_features, in_features / 32 * BLOCK_BYTES[kind]]
    out_features: int
    in_features: int

    def scales(self) -> np.ndarray:
        """[N, blocks, 2] float32: each block's d and m (m = 0 for q8s; for integrity checks)."""
        if self.kind == "q6k":  # d * sc per 16 weights
            d, _ = _q6k_values(self.blocks.numpy())
            return np.stack([d, np.zeros_like(d)], axis=-1)
        if self.kind == "q4k":
            d, m, _ = _q4k_values(self.blocks.numpy().reshape(self.out_features, -1))
            return np.stack([d, m], axis=-1)
        b = self.blocks.numpy().reshape(self.out_features, -1, BLOCK_BYTES[self.kind])
        if self.kind in ("q8s", "q5"):
            d = _f16(b, 0)
            return np.stack([d, np.zeros_like(d)], axis=-1)
        if self.kind in ("iq4", "mx4"):
            d = b[..., :4].copy().view(np.float32)[..., 0]
            return np.stack([d, np.zeros_like(d)], axis=-1)
        if self.kind == "q4h":
            return np.stack([_f16(b, 0), _f16(b, 2)], axis=-1)
        return b[..., :8].copy().view(np.float32)


def _pack(kind: Kind, d: np.ndarray, m: np.ndarray | None, qs: np.ndarray) -> QuantizedWeight:
    """d, m: [N, nb] float (m None for q8s; q8s and q4h store them as f16, so give values an f16
    holds exactly); qs: [N, nb, 16] uint8 (q4, q4h, packed) or [N, nb, 32] int8 (q8, q8s)."""
    n, nb = d.shape
    out = np.empty((n, nb, BLOCK_BYTES[kind]), dtype=np.uint8)
    if kind == "q8s":
        assert m is None, "q8s blocks have no offset"
        out[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
        out[..., 2:] = qs.view(np.uint8)
    elif kind == "q4h":
        assert m is not None, "q4h blocks need an offset"
        out[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
        out[..., 2:4] = m.astype(np.float16)[..., None].view(np.uint8)
        out[..., 4:] = qs.view(np.uint8)
    else:
        assert m is not None, f"{kind} blocks need an offset"
        out[..., 0:4] = d.astype(np.float32)[..., None].view(np.uint8)
        out[..., 4:8] = m.astype(np.float32)[..., None].view(np.uint8)
        out[..., 8:] = qs.view(np.uint8)
    return QuantizedWeight(kind, torch.from_numpy(out.reshape(n, -1)), n, nb * QK)


def _f16_bits(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[..., start : start + 2].copy().view(np.float16)[..., 0]


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[..., start : start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Packed [.., 16] -> values [.., 32] in element order (low nibbles first)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def from_gguf_blocks(type_name: str, raw: np.ndarray, kind: Kind) -> QuantizedWeight:
    """GGUF rows [N, row_bytes] of an EXACT_SOURCES type -> `kind`, keeping its integers and scales."""
    n = raw.shape[0]
    if type_name == "Q6_K":
        k = raw.shape[1] // 210 * QK_K
        if kind == "q6k":  # the file's super-blocks as they are
            return QuantizedWeight("q6k", torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(n, -1)), n, k)
        return _q6k_eight_bit(raw, kind) if kind in ("q8s", "q8") else _requantize_from(_q6k_floats(raw), kind)
    if type_name == "Q3_K":
        q6k = _q3k_as_q6k(raw)  # the same integers and scales in Q6_K's super-blocks (exact)
        return q6k if kind == "q6k" else from_gguf_blocks("Q6_K", q6k.blocks.numpy(), kind)
    if type_name == "Q4_K":
        k = raw.shape[1] // 144 * QK_K
        if kind == "q4k":  # the file's super-blocks as they are
            return QuantizedWeight("q4k", torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(n, -1)), n, k)
        if kind == "q8s":
            raise ValueError("Q4_K has offsets: it maps to q4k or q8, not q8s")
        d, m, q = _q4k_values(raw)
        return _pack("q8", d, m, q.astype(np.int8)) if kind == "q8" else _pack("q4", d, m, q[..., :16] | (q[..., 16:] << 4))
    if type_name == "Q5_K":
        d, m, u = _q5k_values(raw)
        if kind == "q5m":
            return _pack_q5m(d, m, u)
        if kind == "q8s":
            raise ValueError("Q5_K has offsets: it maps to q5m or q8, not q8s")
        return _pack("q8", d, m, u.astype(np.int8)) if kind == "q8" else _requantize_from(d[..., None] * u + m[..., None], kind)
    if type_name == "MXFP4":
        return _mxfp4_blocks(raw, kind)
    if type_name in ("IQ4_NL", "IQ4_XS"):
        d, packed = _iq4_nl_parts(raw, n) if type_name == "IQ4_NL" else _iq4_xs_parts(raw, n)
        if kind == "iq4":
            return _pack_levels("iq4", d, packed)
        q = IQ4_LEVELS[_nibbles(packed)]
        if kind == "q8s" and type_name == "IQ4_NL":  # the file's f16 scale and the levels as int8
            return _pack("q8s", d.astype(np.float16), None, q)
        if kind == "q8":
            return _pack("q8", d, np.zeros_like(d), q)
        return _requantize_from(d[..., None] * q, kind)  # other formats round
    if type_name == "Q4_0":
        b = raw.reshape(n, -1, 18)
        d, qs = _f16(b, 0), b[..., 2:]
        m = -8.0 * d
        if kind == "q4h" and not _holds_f16(m):  # -8 d beyond f16's range: f32 scales instead
            kind = "q4"
    elif type_name == "Q4_1":
        b = raw.reshape(n, -1, 20)
        if kind == "q4h":  # the file's blocks as they are
            return QuantizedWeight("q4h", torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(n, -1)), n, b.shape[1] * QK)
        d, m, qs = _f16(b, 0), _f16(b, 2), b[..., 4:]
    elif type_name == "Q8_0":
        b = raw.reshape(n, -1, 34)
        d, q = _f16(b, 0), b[..., 2:].view(np.int8)
        if kind == "q8s":  # the file's blocks as they are
            return QuantizedWeight("q8s", torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(n, -1)), n, b.shape[1] * QK)
        return _pack("q8", d, np.zeros_like(d), q) if kind == "q8" else _requantize_from(d[..., None] * q, kind)
    elif type_name in ("Q5_0", "Q5_1"):
        header = 2 if type_name == "Q5_0" else 4
        b = raw.reshape(n, -1, header + 4 + QK // 2)
        d = _f16(b, 0)
        m = _f16(b, 2) if type_name == "Q5_1" else np.zeros_like(d)
        q = _five_bit_integers(b[..., header:]).astype(np.int16)
        if type_name == "Q5_0":
            q = q - 16
            if kind == "q5":  # the file's blocks as they are
                return QuantizedWeight("q5", torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(n, -1)), n, b.shape[1] * QK)
            if kind == "q8s":  # symmetric: the f16 scale carries over unchanged
                return _pack("q8s", _f16_bits(b, 0), None, q.astype(np.int8))
        elif kind == "q8s":
            raise ValueError("Q5_1 has offsets: it maps to q5m or q8, not q8s")
        elif kind == "q5m":
            return _pack_q5m(d, m, q.astype(np.uint8))
        return _pack("q8", d, m, q.astype(np.int8))
    else:
        raise ValueError(f"{type_name} has no exact kernel format; use requantize()")
    if kind in ("q4", "q4h"):
        return _pack(kind, d, m, np.ascontiguousarray(qs))
    if kind == "q8s":
        raise ValueError(f"{type_name} has offsets: it maps to q4, q4h or q8, not q8s")
    return _pack("q8", d, m, _nibbles(qs).astype(np.int8))  # 4-bit integers fit int8 exactly


def _mxfp4_blocks(raw: np.ndarray, kind: Kind) -> QuantizedWeight:
    """MXFP4 rows (per 32 weights an e8m0 exponent byte, then 16 bytes of e2m1 codes, low nibbles
    first) -> mx4 (the codes as they are, the scale 2^(e - 128) as f32), or 8-bit blocks of the
    levels with that scale: q8s (f16 scale) where every scale is an f16, else q8 (f32); exact every
    way. Other kinds round the values."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, 17)
    e = b[..., 0].astype(np.int32)
    d = np.ldexp(np.float32(1.0), e - 128).astype(np.float32)  # ggml's e8m0 "half" (e = 0, 1: f32 subnormals)
    if kind == "mx4":
        return _pack_levels("mx4", d, np.ascontiguousarray(b[..., 1:]))
    q = MXFP4_LEVELS[_nibbles(b[..., 1:])]
    d = np.where((q == 0).all(axis=-1), np.float32(0.0), d)  # an all-zero block's scale is anything (llama.cpp writes e = 0)
    if kind == "q8s" and _holds_f16(d):
        return _pack("q8s", d.astype(np.float16), None, q)
    if kind in ("q8s", "q8"):
        return _pack("q8", d, np.zeros_like(d), q)
    return _requantize_from(d[..., None] * q, kind)


def _iq4_nl_parts(raw: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """IQ4_NL rows -> per-block scales [N, nb] (float32 of the file's f16) and packed indices [N, nb, 16]."""
    b = raw.reshape(n, -1, 18)
    return _f16(b, 0), b[..., 2:]


def _iq4_xs_parts(raw: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """IQ4_XS rows -> per-32-weight scales d * (ls - 32) [N, nb] (exact in float32: an f16 times a
    6-bit integer) and packed indices [N, nb, 16]. ls: 4 low bits from scales_l, 2 high from scales_h."""
    b = raw.reshape(n, -1, IQ4_XS_BYTES)
    sub = np.arange(QK_K // QK)
    scales_h = b[..., 2:4].copy().view(np.uint16)[..., :1].astype(np.int32)  # [N, S, 1]
    low = (b[..., 4 + sub // 2].astype(np.int32) >> (4 * (sub % 2))) & 0xF  # [N, S, 8]
    ls = low | (((scales_h >> (2 * sub)) & 3) << 4)
    d = _f16(b, 0)[..., None] * (ls - 32).astype(np.float32)  # [N, S, 8]
    return d.reshape(n, -1), b[..., 8:].reshape(n, -1, QK // 2)


def _pack_q5m(d: np.ndarray, m: np.ndarray, u: np.ndarray) -> QuantizedWeight:
    """d, m [N, nb] float32, u [N, nb, 32] in [0, 31] -> q5m blocks: d, m, then GGUF's 5-bit bytes."""
    n, nb = d.shape
    out = np.empty((n, nb, BLOCK_BYTES["q5m"]), dtype=np.uint8)
    out[..., 0:4] = d.astype(np.float32)[..., None].view(np.uint8)
    out[..., 4:8] = m.astype(np.float32)[..., None].view(np.uint8)
    out[..., 8:] = _five_bit_bytes(u)
    return QuantizedWeight("q5m", torch.from_numpy(out.reshape(n, -1)), n, nb * QK)


def _q5m_values(weight: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q5m -> d, m [N, nb] float32 and u [N, nb, 32] uint8."""
    b = weight.blocks.numpy().reshape(weight.out_features, -1, BLOCK_BYTES["q5m"])
    d, m = b[..., 0:4].copy().view(np.float32)[..., 0], b[..., 4:8].copy().view(np.float32)[..., 0]
    return d, m, _five_bit_integers(b[..., 8:])


def _pack_levels(kind: Kind, d: np.ndarray, packed: np.ndarray) -> QuantizedWeight:
    """d [N, nb] float32, packed level indices [N, nb, 16] -> iq4 or mx4 blocks."""
    n, nb = d.shape
    out = np.empty((n, nb, BLOCK_BYTES[kind]), dtype=np.uint8)
    out[..., 0:4] = d.astype(np.float32)[..., None].view(np.uint8)
    out[..., 4:] = packed
    return QuantizedWeight(kind, torch.from_numpy(out.reshape(n, -1)), n, nb * QK)


def _requantize_from(values: np.ndarray, kind: Kind) -> QuantizedWeight:
    return requantize(torch.from_numpy(values.reshape(values.shape[0], -1).astype(np.float32)), kind)


def requantize(weight: torch.Tensor, kind: Kind) -> QuantizedWeight:
    """Float weight [N, K] -> `kind` by per-block rounding (lossy): q8 / q8s symmetric, q4 / q4h min/max.

    q8s and q4h round with their f16 scales (as llama.cpp's Q8_0 and Q4_1 do); where a block's scale
    (or offset) falls outside f16's full-precision range the whole weight is made q8 / q4 instead
    (f32 scales)."""
    if kind in ("q4k", "q6k"):
        raise ValueError(f"{kind} holds GGUF's super-blocks as the file has them; float weights are not rounded to it")
    w = weight.detach().float().numpy().reshape(weight.shape[0], -1, QK)
    if kind == "q5":  # llama.cpp's Q5_0 rounding: the largest magnitude maps to -16
        extreme = np.take_along_axis(w, np.abs(w).argmax(axis=-1)[..., None], axis=-1)[..., 0]
        d = (extreme / -16.0).astype(np.float16)
        d32 = d.astype(np.float32)
        safe = np.where(d32 != 0, d32, 1.0)
        u = np.clip(np.rint(w / safe[..., None]) + 16, 0, 31).astype(np.uint8)
        return _q5_blocks(d, u)
    if kind == "q8s":
        d = (np.abs(w).max(axis=-1) / 127.0).astype(np.float16)
        used = d[d != 0]
        if used.size and (used.min() < F16_TINY or used.max() > F16_MAX or not np.isfinite(used).all()):
            return requantize(weight, "q8")
        d32 = d.astype(np.float32)
        safe = np.where(d32 > 0, d32, 1.0)
        q = np.clip(np.rint(w / safe[..., None]), -127, 127).astype(np.int8)
        return _pack("q8s", d, None, q)
    if kind == "q8":
        d = np.abs(w).max(axis=-1) / 127.0
        safe = np.where(d > 0, d, 1.0)
        q = np.clip(np.rint(w / safe[..., None]), -127, 127).astype(np.int8)
        return _pack("q8", d, np.zeros_like(d), q)
    low, high = w.min(axis=-1), w.max(axis=-1)
    d = (high - low) / 15.0
    if kind == "q4h":  # round with the f16 scale and offset the block will hold, as llama.cpp's Q4_1
        d, low = d.astype(np.float16).astype(np.float32), low.astype(np.float16).astype(np.float32)
        used = np.abs(np.concatenate([d[d != 0], low[low != 0]]))
        if used.size and (used.min() < F16_TINY or not np.isfinite(used).all()):
            return requantize(weight, "q4")
    safe = np.where(d > 0, d, 1.0)
    q = np.clip(np.rint((w - low[..., None]) / safe[..., None]), 0, 15).astype(np.uint8)
    return _pack("q4h" if kind == "q4h" else "q4", d, low, (q[..., : QK // 2] | (q[..., QK // 2 :] << 4)).astype(np.uint8))


def _holds_f16(values: np.ndarray) -> bool:
    """Whether every value is an f16 exactly."""
    with np.errstate(over="ignore"):  # an overflow is the answer, not an error
        halves = values.astype(np.float16)
    return bool(np.isfinite(halves).all() and (halves.astype(values.dtype) == values).all())


def _five_bit_bytes(u: np.ndarray) -> np.ndarray:
    """u [N, nb, 32] in [0, 31] -> GGUF's 5-bit bytes [N, nb, 20] (Q5_0 / Q5_1 after their scales, and
    q5m's): the fifth bits as a little-endian u32 (bit j: u[j]'s), then nibbles (byte j: u[j]'s low
    nibble, u[j + 16]'s high)."""
    high = ((u >> 4).astype(np.uint32) << np.arange(QK, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
    low = u & 0x0F
    return np.concatenate([high[..., None].view(np.uint8), low[..., : QK // 2] | (low[..., QK // 2 :] << 4)], axis=-1)


def _five_bit_integers(tail: np.ndarray) -> np.ndarray:
    """GGUF's 5-bit bytes [N, nb, 20] -> u [N, nb, 32] uint8 (the inverse of _five_bit_bytes)."""
    high = ((tail[..., 0:4].copy().view(np.uint32) >> np.arange(QK, dtype=np.uint32)) & 1).astype(np.uint8)
    return _nibbles(tail[..., 4:]) | (high << 4)


def _q5_blocks(d: np.ndarray, u: np.ndarray) -> QuantizedWeight:
    """d [N, nb] f16, u [N, nb, 32] in [0, 31] -> GGUF Q5_0 blocks (d, fifth bits, nibbles)."""
    n, nb = d.shape
    out = np.empty((n, nb, BLOCK_BYTES["q5"]), dtype=np.uint8)
    out[..., 0:2] = d[..., None].view(np.uint8)
    out[..., 2:] = _five_bit_bytes(u)
    return QuantizedWeight("q5", torch.from_numpy(out.reshape(n, -1)), n, nb * QK)


def _q5_values(weight: QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """q5 -> (f16 d [N, nb], signed integers u - 16 [N, nb, 32] int8)."""
    b = weight.blocks.numpy().reshape(weight.out_features, -1, BLOCK_BYTES["q5"])
    u = _five_bit_integers(b[..., 2:])
    return _f16_bits(b, 0), (u.astype(np.int16) - 16).astype(np.int8)


def _k_scales_offsets(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K super-blocks [N, S, bytes] (f16 d, f16 dmin, 12 bytes of 6-bit sc and mn at 4)
    -> per 32-weight block d * sc and -dmin * mn [N, S * 8] (float32, both exact)."""
    n = b.shape[0]
    d, dmin, s = _f16(b, 0), _f16(b, 2), b[..., 4:16].astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    scale = (d[..., None] * sc.astype(np.float32)).reshape(n, -1)
    return scale, -(dmin[..., None] * mn.astype(np.float32)).reshape(n, -1)


def _q4k_values(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q4_K rows [N, bytes] -> per 32-weight block d = d * sc and m = -dmin * mn (float32, both
    exact) [N, nb], and q [N, nb, 32] uint8 in [0, 15]: w = d * q + m."""
    n = raw.shape[0]
    b = np.asarray(raw, dtype=np.uint8).reshape(n, -1, 144)
    qs = b[..., 16:].reshape(n, -1, 4, 32)  # 32 bytes per pair of sub-blocks: low nibbles, then high
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, -1, QK)  # [N, nb, 32]
    return (*_k_scales_offsets(b), q)


def _q5k_values(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q5_K rows [N, bytes] -> d * sc, -dmin * mn [N, nb] as Q4_K's and u [N, nb, 32] uint8 in
    [0, 31]: sub-block s takes the low (s even) or high nibbles of bytes 32 (s // 2) .. of qs and bit
    s of each of the 32 qh bytes."""
    n = raw.shape[0]
    b = np.asarray(raw, dtype=np.uint8).reshape(n, -1, 176)
    qh, qs = b[..., 16:48], b[..., 48:].reshape(n, -1, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, -1, 8, QK)  # [N, S, 8, 32]
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [N, S, 8, 32]
    return (*_k_scales_offsets(b), (low | (high << 4)).reshape(n, -1, QK))


def _q6k_values(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q6_K rows [N, bytes] -> d * sc per 16 weights (float32) [N, k / 16] and the signed
    integers u - 32 [N, k / 16, 16] int8: w = (d * sc) * q, gguf's order of rounding."""
    n = raw.shape[0]
    b = np.asarray(raw, dtype=np.uint8).reshape(n, -1, 210)
    ql, qh = b[..., :128].reshape(n, -1, 2, 1, 64), b[..., 128:192].reshape(n, -1, 2, 1, 32)
    low = ((ql >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F).reshape(n, -1, 2, 4, 32)
    top = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3).reshape(n, -1, 2, 4, 32)
    q = ((low | (top << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, -1, 16)
    scale = _f16(b, 208)[..., None] * b[..., 192:208].view(np.int8).astype(np.float32)  # [N, nsb, 16]
    return scale.reshape(n, -1), q


def _q3k_values(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q3_K rows [N, bytes] (32 bytes of high bits, 64 of 2-bit pairs, 12 of 6-bit scales, f16 d)
    -> d as f16 [N, S], the signed scales sc - 32 [N, S, 16] int8 in [-32, 31] and the signed integers
    [N, S, 256] int8 in [-4, 3]: w = d * (sc - 32) * q, gguf's order of rounding."""
    n = raw.shape[0]
    b = np.asarray(raw, dtype=np.uint8).reshape(n, -1, Q3K_BYTES)
    hmask, qs, packed = b[..., 0:32], b[..., 32:96], b[..., 96:108]
    low = np.concatenate([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], axis=-1)  # scale j's low four bits
    high = (packed[..., None, 8:12] >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3  # [.., 4, 4]: j // 4, j % 4
    sc = ((low | (high.reshape(n, -1, 16) << 4)).astype(np.int16) - 32).astype(np.int8)
    pairs = (qs.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3  # weight 128 h + 32 s + l
    top = (hmask[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # weight 32 bit + l
    q = pairs.reshape(n, -1, QK_K).astype(np.int8) - 4 * (1 - top.reshape(n, -1, QK_K)).astype(np.int8)
    return _f16_bits(b, 108), sc, q


def _q6k_super_blocks(d: np.ndarray, sc: np.ndarray, u: np.ndarray) -> np.ndarray:
    """d [N, S] f16, sc [N, S, 16] int8, u [N, S, 256] in [0, 63] -> GGUF Q6_K rows [N, S * 210]
    (the inverse of _q6k_values): per half h, ql's 64 bytes hold weights 128 h + l (low nibble) and
    + 64 (high), l < 64; qh's 32 bytes hold the top two bits of 128 h + 32 i + l at bits 2 i."""
    n, s = d.shape
    halves = u.reshape(n, s, 2, 4, 32)
    ql = (halves[:, :, :, 0:2] & 0x0F) | ((halves[:, :, :, 2:4] & 0x0F) << 4)  # [N, S, 2, 2, 32]
    qh = ((halves >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=3, dtype=np.uint8)  # [N, S, 2, 32]
    out = np.empty((n, s, SUPER_BLOCK_BYTES["q6k"]), dtype=np.uint8)
    out[..., 0:128] = ql.reshape(n, s, 128)
    out[..., 128:192] = qh.reshape(n, s, 64)
    out[..., 192:208] = sc.view(np.uint8)
    out[..., 208:210] = d[..., None].view(np.uint8)
    return out.reshape(n, -1)


def _q3k_as_q6k(raw: np.ndarray) -> QuantizedWeight:
    """Q3_K rows -> q6k with the same f16 d, scales sc - 32 and integers q (u = q + 32): exact."""
    d, sc, q = _q3k_values(raw)
    blocks = _q6k_super_blocks(d, sc, (q.astype(np.int16) + 32).astype(np.uint8))
    return QuantizedWeight("q6k", torch.from_numpy(blocks), raw.shape[0], d.shape[1] * QK_K)


def to_q8s(weight: QuantizedWeight) -> QuantizedWeight:
    """q5 -> q8s with the same integers and scales (exact), for fusing with q8s rows."""
    if weight.kind == "q8s":
        return weight
    assert weight.kind == "q5", f"{weight.kind} has offsets: it cannot become q8s"
    d, q = _q5_values(weight)
    return _pack("q8s", d, None, q)


def _q6k_floats(raw: np.ndarray) -> np.ndarray:
    """Q6_K rows -> their weights [N, k] float32, gguf's values."""
    scale, q = _q6k_values(raw)
    return (scale[..., None] * q.astype(np.float32)).reshape(raw.shape[0], -1)


def _q6k_eight_bit(raw: np.ndarray, kind: Literal["q8s", "q8"]) -> QuantizedWeight:
    """Q6_K rows -> 8-bit blocks. A 32-weight block keeps its integers p = sc * (u - 32) with the
    super-block's d where they fit: in q8s where every p fits int8 (the same integer dots as q6k's),
    in q8 where they span at most 254, less an integer c carried by the offset c d. Q3_K's products
    (-124 .. 128) always fit q8 so; q8s only without a 128 (about 89% of a real file's blocks).
    Other blocks (Q6_K's: two 8-bit scales per 32 weights) are rounded."""
    n = raw.shape[0]
    scale, q = _q6k_values(raw)
    weight = _requantize_from(scale[..., None] * q.astype(np.float32), kind)  # may widen q8s to q8 (scales beyond f16)
    b = np.asarray(raw, dtype=np.uint8).reshape(n, -1, SUPER_BLOCK_BYTES["q6k"])
    products = (b[..., 192:208].view(np.int8).reshape(n, -1).astype(np.int16)[..., None] * q).reshape(n, -1, QK)
    low, high = products.min(axis=-1), products.max(axis=-1)  # [N, nb]
    shift = np.zeros_like(low) if weight.kind == "q8s" else np.clip(0, high - 127, low + 127)
    fits = (high - shift <= 127) & (low - shift >= -127)
    d = np.repeat(_f16_bits(b, 208), QK_K // QK, axis=1)  # each block's super-block d
    blocks = weight.blocks.numpy().reshape(n, -1, BLOCK_BYTES[weight.kind])
    ints = 2 if weight.kind == "q8s" else 8
    blocks[..., ints:][fits] = (products - shift[..., None])[fits].astype(np.int8).view(np.uint8)
    if weight.kind == "q8s":
        blocks[..., 0:2][fits] = d[fits][:, None].view(np.uint8)
    else:
        d32 = d[fits].astype(np.float32)
        blocks[..., 0:8][fits] = np.stack([d32, d32 * shift[fits].astype(np.float32)], axis=-1).view(np.uint8)
    return weight


def _q6k_as_q8s(weight: QuantizedWeight) -> QuantizedWeight:
    return _q6k_eight_bit(weight.blocks.numpy(), "q8s")


def to_q8(weight: QuantizedWeight) -> QuantizedWeight:
    """q4 / q4h / q8s / q5 / q4k / iq4 / mx4 / q5m -> q8 with the same integers and scales (exact), for fusing
    with q8 rows; q6k (two scales per 32 weights) is rounded to q8."""
    if weight.kind == "q8":
        return weight
    if weight.kind == "q5m":
        d, m, u = _q5m_values(weight)
        return _pack("q8", d, m, u.astype(np.int8))
    if weight.kind in ("iq4", "mx4"):
        b = weight.blocks.numpy().reshape(weight.out_features, -1, BLOCK_BYTES[weight.kind])
        d = b[..., :4].copy().view(np.float32)[..., 0]
        levels = IQ4_LEVELS if weight.kind == "iq4" else MXFP4_LEVELS
        return _pack("q8", d, np.zeros_like(d), levels[_nibbles(b[..., 4:])])
    if weight.kind == "q6k":
        return _q6k_eight_bit(weight.blocks.numpy(), "q8")
    if weight.kind == "q4k":
        d, m, q = _q4k_values(weight.blocks.numpy())
        return _pack("q8", d, m, q.astype(np.int8))
    if weight.kind == "q5":
        weight = to_q8s(weight)
    if weight.kind == "q8s":
        b = weight.blocks.numpy().reshape(weight.out_features, -1, BLOCK_BYTES["q8s"])
        d = _f16(b, 0)
        return _pack("q8", d, np.zeros_like(d), b[..., 2:].view(np.int8))
    d, m, qs = _q4_parts(weight)
    return _pack("q8", d, m, _nibbles(qs).astype(np.int8))


def _q4_parts(weight: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q4 / q4h -> d, m [N, nb] float32 and the packed nibbles [N, nb, 16]."""
    b = weight.blocks.numpy().reshape(weight.out_features, -1, BLOCK_BYTES[weight.kind])
    if weight.kind == "q4h":
        return _f16(b, 0), _f16(b, 2), b[..., 4:]
    return b[..., 0:4].copy().view(np.float32)[..., 0], b[..., 4:8].copy().view(np.float32)[..., 0], b[..., 8:]


def to_q4(weight: QuantizedWeight) -> QuantizedWeight:
    """q4h -> q4 with the same integers and scales (exact), for fusing with q4 rows."""
    if weight.kind == "q4":
        return weight
    assert weight.kind == "q4h", f"{weight.kind} is not a 4-bit block format"
    d, m, qs = _q4_parts(weight)
    return _pack("q4", d, m, np.ascontiguousarray(qs))


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack output rows (fused QKV, gate/up); mixed formats meet in q4 (4-bit ones), q8s or q8 (exact
    for each)."""
    kinds = {w.kind for w in weights}
    if len(kinds) > 1 and "q6k" in kinds and kinds <= {"q6k", "q5", "q8s"}:  # rounded to q8s, as before q6k
        weights = [to_q8s(w) if w.kind != "q6k" else _q6k_as_q8s(w) for w in weights]
    elif len(kinds) > 1 and kinds <= {"q4", "q4h"}:
        weights = [to_q4(w) for w in weights]
    elif len(kinds) > 1:
        weights = [to_q8s(w) for w in weights] if kinds <= {"q5", "q8s"} else [to_q8(w) for w in weights]
    first = weights[0]
    assert all(w.in_features == first.in_features for w in weights), "fused weights need one input size"
    blocks = torch.cat([w.blocks for w in weights], dim=0)
    return QuantizedWeight(first.kind, blocks, blocks.shape[0], first.in_features)

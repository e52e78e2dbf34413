"""Random but valid GGUF K-quant (and IQ4_XS) rows, for kernels tests that need no model file."""

from __future__ import annotations

import numpy as np

from kvgen.kernels.formats import QuantizedWeight, from_gguf_blocks


def random_super_blocks(n: int, k: int, block_bytes: int, f16_at: tuple[int, ...], low: float = 1e-4, seed: int = 0) -> np.ndarray:
    """n rows of random GGUF super-blocks [n, k / 256 * block_bytes] whose f16 fields (at byte offsets
    `f16_at`) hold small finite scales drawn from [low, 10 low) and every other byte is random: valid
    for the K-quants and IQ4_XS, whose other fields take any bits."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // 256, block_bytes), dtype=np.uint8)
    for at in f16_at:
        blocks[..., at : at + 2] = (rng.uniform(low, 10 * low, size=(n, k // 256)).astype(np.float16))[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


def random_q3k(n: int, k: int, seed: int = 0, fits_int8: bool = False) -> np.ndarray:
    """Q3_K: random high bits, bit pairs and 6-bit scales, f16 d last. With `fits_int8` every 6-bit
    scale is odd, so no sc - 32 is -32 and every product (sc - 32) * q fits int8."""
    blocks = random_super_blocks(n, k, 110, (108,), low=1e-2, seed=seed).reshape(n, -1, 110)
    if fits_int8:
        blocks[..., 96:104] |= 0x11  # each scale's low four bits: odd
    return blocks.reshape(n, -1)


def random_q4k(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Q4_K: f16 d and dmin, then random 6-bit scales, mins and nibbles."""
    return random_super_blocks(n, k, 144, (0, 2), seed=seed)


def q4k_weight(n: int, k: int, seed: int = 0) -> QuantizedWeight:
    return from_gguf_blocks("Q4_K", random_q4k(n, k, seed), "q4k")


def random_q5k(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Q5_K: f16 d and dmin, then random 6-bit scales and mins, fifth bits and nibbles."""
    return random_super_blocks(n, k, 176, (0, 2), seed=seed)


def q5m_weight(n: int, k: int, seed: int = 0) -> QuantizedWeight:
    return from_gguf_blocks("Q5_K", random_q5k(n, k, seed), "q5m")


def random_q6k(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Q6_K: random 6-bit integers and int8 scales, f16 d last."""
    return random_super_blocks(n, k, 210, (208,), low=1e-5, seed=seed)


def q6k_weight(n: int, k: int, seed: int = 0) -> QuantizedWeight:
    return from_gguf_blocks("Q6_K", random_q6k(n, k, seed), "q6k")


def iq4_weight(n: int, k: int, seed: int = 0) -> QuantizedWeight:
    """IQ4_XS (k a multiple of 256) as the iq4 kernels hold it: random indices, 6-bit sub-block scales
    (some negative) and an f16 d per super-block."""
    return from_gguf_blocks("IQ4_XS", random_super_blocks(n, k, 136, (0,), seed=seed), "iq4")

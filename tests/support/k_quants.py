"""Random but valid GGUF K-quant (and IQ4_XS) rows, for kernels tests that need no model file."""

from __future__ import annotations

import numpy as np

from kvgen.kernels.formats import QuantizedWeight, from_gguf_blocks


def random_q4k(n: int, k: int, seed: int = 0) -> np.ndarray:
    """n rows of valid Q4_K bytes [n, k / 256 * 144]: random 6-bit scales, mins and nibbles."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = (rng.uniform(1e-4, 1e-3, size=(n, k // 256)).astype(np.float16))[..., None].view(np.uint8)
    blocks[..., 2:4] = (rng.uniform(1e-4, 1e-3, size=(n, k // 256)).astype(np.float16))[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


def q4k_weight(n: int, k: int, seed: int = 0) -> QuantizedWeight:
    return from_gguf_blocks("Q4_K", random_q4k(n, k, seed), "q4k")


def random_q6k(n: int, k: int, seed: int = 0) -> np.ndarray:
    """n rows of valid Q6_K bytes [n, k / 256 * 210]: random 6-bit integers and int8 scales."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // 256, 210), dtype=np.uint8)
    blocks[..., 208:210] = (rng.uniform(1e-5, 1e-4, size=(n, k // 256)).astype(np.float16))[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


def q6k_weight(n: int, k: int, seed: int = 0) -> QuantizedWeight:
    return from_gguf_blocks("Q6_K", random_q6k(n, k, seed), "q6k")


def iq4_weight(n: int, k: int, seed: int = 0) -> QuantizedWeight:
    """n rows of IQ4_XS (k a multiple of 256) as the iq4 kernels hold them: random indices, 6-bit
    sub-block scales (some negative) and an f16 d per super-block."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // 256, 136), dtype=np.uint8)
    blocks[..., 0:2] = (rng.uniform(1e-4, 1e-3, size=(n, k // 256)).astype(np.float16))[..., None].view(np.uint8)
    return from_gguf_blocks("IQ4_XS", blocks.reshape(n, -1), "iq4")


def random_q5k(n: int, k: int, seed: int = 0) -> np.ndarray:
    """n rows of valid Q5_K bytes [n, k / 256 * 176]: random 6-bit scales and mins, fifth bits and nibbles."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // 256, 176), dtype=np.uint8)
    blocks[..., 0:2] = (rng.uniform(1e-4, 1e-3, size=(n, k // 256)).astype(np.float16))[..., None].view(np.uint8)
    blocks[..., 2:4] = (rng.uniform(1e-4, 1e-3, size=(n, k // 256)).astype(np.float16))[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


def q5m_weight(n: int, k: int, seed: int = 0) -> QuantizedWeight:
    return from_gguf_blocks("Q5_K", random_q5k(n, k, seed), "q5m")

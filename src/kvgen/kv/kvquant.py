"""KVQuant-style 3-bit K/V storage (Hooper et al. 2024), calibrated once per model.

Keys: quantized BEFORE RoPE (pre-RoPE channels keep stable, per-channel distributions; RoPE mixes
them per position), per channel: each channel of a packed block is normalised to [0, 1] by its min
and max over the block's positions. Values: per position, in groups of CHANNEL_GROUP channels
normalised the same way. Each normalised value gets a 3-bit code into its layer's 8-level
non-uniform codebook (one for keys, one for values). Codebooks are fit by sensitivity-weighted
k-means on a calibration pass, the weight of each sample being its Fisher information (the squared
gradient of the calibration loss with respect to that cached value; squared activations when the
weights cannot be differentiated, e.g. C-kernel quantized weights). Dense-and-sparse, for keys: per
position the `outliers` channels with the largest rounding error are stored exactly (fp16 value +
uint8 channel index). The first position (the attention sink) stays in full precision.

Why per-block key scales rather than KVQuant's offline per-channel ones: codebooks fit per channel
on one calibration paragraph did not carry over to other text (SmolLM2, Hamlet: key-only KLD 0.026,
worse than uniform int3's 0.022); normalising each channel over its block measured 0.0056.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgen.kv.bitpack import pack, unpack
from kvgen.kv.codecs import CHANNEL_GROUP, MIN_STEP, Codec, Parts

LEVELS = 8  # 3 bits
KMEANS_ITERATIONS = 40


@dataclass(frozen=True)
class Codebooks:
    keys: torch.Tensor  # [layers, LEVELS] sorted, in the [0, 1] space of a channel normalised over a block
    values: torch.Tensor  # [layers, LEVELS] sorted, in the [0, 1] space of a normalised group
    weighting: str  # "fisher" or "activation^2"


def weighted_kmeans(x: torch.Tensor, weights: torch.Tensor, levels: int = LEVELS) -> torch.Tensor:
    """1-D weighted k-means per row: x, weights [N, T] -> sorted centroids [N, levels].

    Deterministic: starts from the rows' quantiles and runs a fixed number of Lloyd steps.
    """
    centroids = torch.quantile(x, (torch.arange(levels, dtype=x.dtype) + 0.5) / levels, dim=1).T.contiguous()
    for _ in range(KMEANS_ITERATIONS):
        codes = nearest(x, centroids)  # [N, T]
        mass = torch.zeros_like(centroids).scatter_add_(1, codes, weights)
        total = torch.zeros_like(centroids).scatter_add_(1, codes, weights * x)
        centroids = torch.where(mass > 0, total / mass.clamp(min=1e-30), centroids).sort(dim=1).values
    return centroids


def nearest(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest sorted centroid: x [..., T] against centroids [..., K] (leading dims match)."""
    midpoints = (centroids[..., 1:] + centroids[..., :-1]) / 2  # [..., K-1]
    return (x[..., :, None] > midpoints[..., None, :]).sum(-1)


def _keep_outliers(x: torch.Tensor, rounded: torch.Tensor, count: int) -> Parts:
    """The `count` channels per position where rounding erred most, stored exactly."""
    if count == 0:
        return {}
    index = (x - rounded).abs().topk(count, dim=-1).indices  # [..., count]
    return {"outlier_index": index.to(torch.uint8), "outlier_value": x.gather(-1, index).to(torch.float16)}


def _restore_outliers(rounded: torch.Tensor, parts: Parts) -> torch.Tensor:
    if "outlier_index" in parts:
        rounded.scatter_(-1, parts["outlier_index"].long(), parts["outlier_value"].float())
    return rounded


def normalise(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max normalisation of x along `dim` to [0, 1]: fp16 low and span (as stored) and the
    normalised x, computed with the rounded low and span so codes match what is read back."""
    low = x.amin(dim, keepdim=True).to(torch.float16)
    span = (x.amax(dim, keepdim=True) - low.float()).clamp(min=MIN_STEP).to(torch.float16)
    return low, span, (x - low.float()) / span.float()


def _codes(normalised: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of a sorted 1-D codebook, for every element (as `nearest`)."""
    return torch.bucketize(normalised, (codebook[1:] + codebook[:-1]) / 2)


class KVQuantKeyCodec(Codec):
    """Pre-RoPE keys per channel: each channel of a block is min/max-normalised over the block's
    positions (keys have outlier channels; per channel they are smooth), then 3-bit codes into the
    layer's codebook, plus the `outliers` channels per position that rounding erred most on, exact."""

    name = "kvquant3"
    keys_before_rope = True
    sink_tokens = 1
    per_position = False  # a block's positions share each channel's low and span
    same_for_every_layer = False

    def __init__(self, codebooks: torch.Tensor, outliers: int):
        self.codebooks, self.outliers = codebooks, outliers  # [layers, LEVELS]

    def encode(self, x: torch.Tensor, layer: int) -> Parts:
        low, span, normalised = normalise(x, dim=2)  # [H, N, 1, D]
        codes = _codes(normalised, self.codebooks[layer])  # [H, N, B, D]
        parts = {"codes": pack(codes, 3), "low": low, "span": span}
        return parts | _keep_outliers(x, self._dequantize(parts, codes, layer), self.outliers)

    def _dequantize(self, parts: Parts, codes: torch.Tensor, layer: int) -> torch.Tensor:
        return self.codebooks[layer][codes] * parts["span"].float() + parts["low"].float()

    def decode(self, parts: Parts, layer: int) -> torch.Tensor:
        return _restore_outliers(self._dequantize(parts, unpack(parts["codes"], 3), layer), parts)


class KVQuantValueCodec(Codec):
    """Values per position: min/max-normalised groups of CHANNEL_GROUP channels, 3-bit codes into the
    layer's codebook (plus `outliers` exact channels per position; kvgen uses none for values: they
    measured no better on SmolLM2, KLD 0.0017 vs 0.0018, for 0.375 more bits per value)."""

    name = "kvquant3"
    sink_tokens = 1
    same_for_every_layer = False

    def __init__(self, codebooks: torch.Tensor, outliers: int = 0):
        self.codebooks, self.outliers = codebooks, outliers  # [layers, LEVELS]

    def encode(self, x: torch.Tensor, layer: int) -> Parts:
        low, span, normalised = normalise(x.reshape(*x.shape[:-1], -1, CHANNEL_GROUP), dim=-1)  # [H, N, B, D/G, G]
        codes = _codes(normalised, self.codebooks[layer])
        parts = {"codes": pack(codes.flatten(-2), 3), "low": low, "span": span}
        return parts | _keep_outliers(x, self._dequantize(parts, codes, layer), self.outliers)

    def _dequantize(self, parts: Parts, codes: torch.Tensor, layer: int) -> torch.Tensor:
        return (self.codebooks[layer][codes] * parts["span"].float() + parts["low"].float()).flatten(-2)

    def decode(self, parts: Parts, layer: int) -> torch.Tensor:
        codes = unpack(parts["codes"], 3).reshape(*parts["low"].shape[:-1], CHANNEL_GROUP)
        return _restore_outliers(self._dequantize(parts, codes, layer), parts)


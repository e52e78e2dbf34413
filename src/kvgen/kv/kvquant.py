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

import hashlib
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvgen.kv.bitpack import pack, unpack
from kvgen.kv.codecs import BLOCK_TOKENS, CHANNEL_GROUP, MIN_STEP, Codec, Parts, key_codec, value_codec
from kvgen.kv.interface import CacheSpec, KVCache
from kvgen.kv.quantized import QuantizedCache
from kvgen.models.base import DecoderLM
from kvgen.models.rotary import rotate_half

LEVELS = 8  # 3 bits
KMEANS_ITERATIONS = 40
CALIBRATION_TEXT = (
    "The committee met on a grey Tuesday morning to decide what should be done about the old bridge. "
    "Some members argued that it ought to be repaired, since the town had crossed it for two hundred years "
    "and the stone was still sound; others pointed to the cracks along the northern arch and to the cost of "
    "divers, scaffolding and engineers. A farmer who had driven his cattle over it since boyhood asked to "
    "speak. \"I do not know the first thing about arches,\" he said, \"but I know that the river rose higher "
    "last spring than my father ever saw it rise, and that the water came within a hand's breadth of the road.\" "
    "Nobody answered at once. The chairwoman wrote three numbers on the board: the price of repair, the price "
    "of a new crossing, and the number of days the valley would be cut in two if nothing were done and the "
    "bridge failed in the next flood. Then she turned to the engineer, who had said nothing so far, and asked "
    "him which of the three numbers he would trust least. He smiled, took off his glasses, and said that the "
    "third one was the only number on the board that nobody in the room could change."
)


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


def _normalise(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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

    def __init__(self, codebooks: torch.Tensor, outliers: int):
        self.codebooks, self.outliers = codebooks, outliers  # [layers, LEVELS]

    def encode(self, x: torch.Tensor, layer: int) -> Parts:
        low, span, normalised = _normalise(x, dim=2)  # [H, N, 1, D]
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

    def __init__(self, codebooks: torch.Tensor, outliers: int = 0):
        self.codebooks, self.outliers = codebooks, outliers  # [layers, LEVELS]

    def encode(self, x: torch.Tensor, layer: int) -> Parts:
        low, span, normalised = _normalise(x.reshape(*x.shape[:-1], -1, CHANNEL_GROUP), dim=-1)  # [H, N, B, D/G, G]
        codes = _codes(normalised, self.codebooks[layer])
        parts = {"codes": pack(codes.flatten(-2), 3), "low": low, "span": span}
        return parts | _keep_outliers(x, self._dequantize(parts, codes, layer), self.outliers)

    def _dequantize(self, parts: Parts, codes: torch.Tensor, layer: int) -> torch.Tensor:
        return (self.codebooks[layer][codes] * parts["span"].float() + parts["low"].float()).flatten(-2)

    def decode(self, parts: Parts, layer: int) -> torch.Tensor:
        codes = unpack(parts["codes"], 3).reshape(*parts["low"].shape[:-1], CHANNEL_GROUP)
        return _restore_outliers(self._dequantize(parts, codes, layer), parts)


class _GradientRecorder(KVCache):
    """A one-pass cache that adds a zero leaf to every stored K/V, so backward gives d loss / d K/V."""

    def __init__(self, spec: CacheSpec):
        self.spec = spec
        self.stored: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    seq_len = 0
    capacity = 1 << 30

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dk, dv = torch.zeros_like(keys, requires_grad=True), torch.zeros_like(values, requires_grad=True)
        self.stored[layer] = (keys.detach(), values.detach(), dk, dv)
        return keys + dk, values + dv

    def commit(self, num_tokens: int) -> None: ...
    def truncate(self, num_tokens: int) -> None: ...
    def fork(self) -> KVCache:
        raise NotImplementedError
    def memory_bytes(self) -> int:
        return 0


def _key_rope(model: DecoderLM) -> Any:
    def rope(layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = model.rope_for(layer)(positions[None], torch.float32)  # [1, 1, N, D]
        return cos[0, 0], sin[0, 0]

    return rope


def calibrate(model: DecoderLM, ids: list[int]) -> Codebooks:
    """Record every layer's K/V (and their Fisher weights) over `ids`, then fit the codebooks."""
    recorder, weighting = _GradientRecorder(CacheSpec.for_model(model.config)), "fisher"
    try:
        with torch.inference_mode(False), torch.enable_grad():
            logits = model(torch.tensor([ids]), recorder, logits_to_keep=len(ids))[0]  # [T, V]
            F.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:])).backward()
    except RuntimeError:  # weights autograd cannot go through (C kernels, in-place scratch)
        recorder, weighting = _GradientRecorder(CacheSpec.for_model(model.config)), "activation^2"
        with torch.no_grad():
            model(torch.tensor([ids]), recorder, logits_to_keep=1)
    rope, positions = _key_rope(model), torch.arange(len(ids))
    key_books, value_books = [], []
    for layer in range(model.config.num_layers):
        keys, values, dk, dv = recorder.stored[layer]
        cos, sin = rope(layer, positions)
        keys = (keys[0] * cos - rotate_half(keys[0]) * sin)[:, 1:]  # [H, T-1, D] pre-RoPE, sink left out
        if weighting == "fisher":
            grad = dk.grad[0]  # RoPE is a rotation: the pre-RoPE gradient is the gradient un-rotated
            key_weight = (grad * cos - rotate_half(grad) * sin)[:, 1:] ** 2
            value_weight = dv.grad[0, :, 1:] ** 2
        else:
            key_weight, value_weight = keys**2, values[0, :, 1:] ** 2
        key_books.append(_fit(*_key_blocks(keys, key_weight)))
        heads, tokens, dim = keys.shape
        grouped = values[0, :, 1:].reshape(heads, tokens, -1, CHANNEL_GROUP)
        _, _, normalised = _normalise(grouped, dim=-1)
        value_books.append(_fit(normalised, value_weight))
    return Codebooks(torch.stack(key_books), torch.stack(value_books), weighting)


def _key_blocks(keys: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibration keys [H, T, D] cut into blocks of BLOCK_TOKENS positions (what the codec packs),
    each channel normalised over its block; the weights cut the same way."""
    heads, tokens, dim = keys.shape
    block = min(BLOCK_TOKENS, tokens)
    whole = tokens // block * block
    _, _, normalised = _normalise(keys[:, :whole].reshape(heads, -1, block, dim), dim=2)
    return normalised, weight[:, :whole]


def _fit(normalised: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One codebook for all of a layer's normalised samples."""
    return weighted_kmeans(normalised.reshape(1, -1), _floored(weight.reshape(1, -1)))[0]


def _floored(weights: torch.Tensor) -> torch.Tensor:
    """Every sample keeps a little weight, so a channel the loss never looked at still gets a codebook."""
    return weights + 1e-3 * weights.mean() + 1e-30


_CODEBOOKS: "weakref.WeakKeyDictionary[DecoderLM, Codebooks]" = weakref.WeakKeyDictionary()
CALIBRATION_VERSION = 2  # bump when calibrate() changes, so stale files are not reused


def calibration_path(model: DecoderLM, ids: list[int]) -> Path:
    """Where this model's codebooks are kept on disk: keyed by its config, a sample of its weights
    (the embedding and final norm) and the calibration tokens."""
    digest = hashlib.sha256(f"{CALIBRATION_VERSION} {model.config} {ids}".encode())
    for tensor in (model.embed_tokens.data[::97], model.norm.weight.data):
        digest.update(tensor.float().contiguous().numpy().tobytes())
    base = Path(os.environ.get("KVGEN_CACHE_DIR", Path.home() / ".cache" / "kvgen"))
    return base / "kvquant" / f"{digest.hexdigest()[:24]}.pt"


def codebooks_for(model: DecoderLM, tokenizer: Any) -> Codebooks:
    """The model's codebooks: calibrated on CALIBRATION_TEXT on first use (a forward and backward
    pass), then kept with the model and on disk (KVGEN_CACHE_DIR, default ~/.cache/kvgen)."""
    if model not in _CODEBOOKS:
        ids = tokenizer.encode(CALIBRATION_TEXT)
        path = calibration_path(model, ids)
        if path.is_file():
            saved = torch.load(path, weights_only=True)
            books = Codebooks(saved["keys"], saved["values"], saved["weighting"])
        else:
            books = calibrate(model, ids)
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")  # atomic: readers never see half a file
            torch.save({"keys": books.keys, "values": books.values, "weighting": books.weighting}, partial)
            partial.replace(path)
        _CODEBOOKS[model] = books
    return _CODEBOOKS[model]


def outliers_for(head_dim: int) -> int:
    return max(1, head_dim // 64)  # ~1.6% of channels, as KVQuant's 1% dense-and-sparse


def build_quantized_cache(model: DecoderLM, tokenizer: Any, capacity: int, max_capacity: int, k_dtype: str,
                          v_dtype: str, residual: int = 32) -> QuantizedCache:  # fmt: skip
    """A QuantizedCache for `model`: kvquant3 codecs get the model's codebooks and its RoPE tables."""
    scaling = model.config.rope_scaling
    if k_dtype == "kvquant3" and scaling is not None and scaling.kind == "longrope":
        # Keys stored before RoPE are rotated at read time by position alone; LongRoPE's rotation
        # also depends on how long the sequence has grown, so the read would be wrong.
        raise ValueError("k_dtype 'kvquant3' stores keys before RoPE, which LongRoPE (Phi-3) models cannot use; "
                         "choose another key dtype (e.g. int8 or int4)")
    spec = CacheSpec.for_model(model.config, model.dtype)
    outliers = outliers_for(spec.head_dim)
    if "kvquant3" in (k_dtype, v_dtype):
        books = codebooks_for(model, tokenizer)
    key = KVQuantKeyCodec(books.keys, outliers) if k_dtype == "kvquant3" else key_codec(k_dtype)
    value = KVQuantValueCodec(books.values) if v_dtype == "kvquant3" else value_codec(v_dtype)
    return QuantizedCache(spec, capacity, max_capacity, key, value, residual, key_rope=_key_rope(model))

"""KVQuant-style 3-bit K/V storage (Hooper et al. 2024), calibrated once per model.

Keys: quantized BEFORE RoPE (pre-RoPE channels keep stable, per-channel distributions; RoPE mixes
them per position), each (layer, head, channel) with its own 8-level codebook. Values: per position,
in groups of CHANNEL_GROUP channels normalised to [0, 1] by their min and max, with one 8-level
codebook per layer. Codebooks are fit by sensitivity-weighted k-means on a calibration pass, the
weight of each sample being its Fisher information (the squared gradient of the calibration loss
with respect to that cached value; squared activations when the weights cannot be differentiated,
e.g. C-kernel quantized weights). Dense-and-sparse: per position the `outliers` channels with the
largest rounding error are stored exactly (fp16 value + uint8 channel index). The first position
(the attention sink) stays in full precision.
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
from kvgen.kv.codecs import CHANNEL_GROUP, MIN_STEP, Codec, Parts, key_codec, value_codec
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
    keys: torch.Tensor  # [layers, H, D, LEVELS] sorted, pre-RoPE key values per channel
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


class KVQuantKeyCodec(Codec):
    """Pre-RoPE keys: 3-bit codes into per-channel codebooks, plus exact outliers."""

    name = "kvquant3"
    keys_before_rope = True
    sink_tokens = 1

    def __init__(self, codebooks: torch.Tensor, outliers: int):
        self.codebooks, self.outliers = codebooks, outliers  # [layers, H, D, LEVELS]

    def encode(self, x: torch.Tensor, layer: int) -> Parts:
        book = self.codebooks[layer][:, None, None]  # [H, 1, 1, D, LEVELS]
        codes = nearest(x[..., None], book.expand(*x.shape, LEVELS))[..., 0]  # [H, N, B, D]
        rounded = self._lookup(codes, layer)
        return {"codes": pack(codes, 3), **_keep_outliers(x, rounded, self.outliers)}

    def _lookup(self, codes: torch.Tensor, layer: int) -> torch.Tensor:
        heads, blocks, tokens, dim = codes.shape
        book = self.codebooks[layer]  # [H, D, LEVELS]
        flat = codes + LEVELS * torch.arange(dim) + LEVELS * dim * torch.arange(heads)[:, None, None, None]
        return book.reshape(-1)[flat]

    def decode(self, parts: Parts, layer: int) -> torch.Tensor:
        return _restore_outliers(self._lookup(unpack(parts["codes"], 3), layer), parts)


class KVQuantValueCodec(Codec):
    """Values per position: min/max-normalised groups of CHANNEL_GROUP channels, 3-bit codes into the
    layer's codebook, plus exact outliers."""

    name = "kvquant3"
    sink_tokens = 1

    def __init__(self, codebooks: torch.Tensor, outliers: int):
        self.codebooks, self.outliers = codebooks, outliers  # [layers, LEVELS]

    def encode(self, x: torch.Tensor, layer: int) -> Parts:
        grouped = x.reshape(*x.shape[:-1], -1, CHANNEL_GROUP)  # [H, N, B, D/G, G]
        low = grouped.amin(-1, keepdim=True).to(torch.float16)
        span = (grouped.amax(-1, keepdim=True) - low.float()).clamp(min=MIN_STEP).to(torch.float16)
        normalised = (grouped - low.float()) / span.float()
        codes = nearest(normalised, self.codebooks[layer].expand(*normalised.shape[:-1], LEVELS))
        parts = {"codes": pack(codes.flatten(-2), 3), "low": low, "span": span}
        rounded = self._dequantize(parts, codes, layer)
        return parts | _keep_outliers(x, rounded, self.outliers)

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
        heads, tokens, dim = keys.shape
        key_rows = keys.permute(0, 2, 1).reshape(heads * dim, tokens)
        key_weight = key_weight.permute(0, 2, 1).reshape(heads * dim, tokens)
        key_books.append(weighted_kmeans(key_rows, _floored(key_weight)).reshape(heads, dim, LEVELS))
        grouped = values[0, :, 1:].reshape(heads, tokens, -1, CHANNEL_GROUP)
        low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
        normalised = ((grouped - low) / (high - low).clamp(min=MIN_STEP)).reshape(1, -1)
        value_books.append(weighted_kmeans(normalised, _floored(value_weight.reshape(1, -1)))[0])
    return Codebooks(torch.stack(key_books), torch.stack(value_books), weighting)


def _floored(weights: torch.Tensor) -> torch.Tensor:
    """Every sample keeps a little weight, so a channel the loss never looked at still gets a codebook."""
    return weights + 1e-3 * weights.mean() + 1e-30


_CODEBOOKS: "weakref.WeakKeyDictionary[DecoderLM, Codebooks]" = weakref.WeakKeyDictionary()
CALIBRATION_VERSION = 1  # bump when calibrate() changes, so stale files are not reused


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
    spec = CacheSpec.for_model(model.config, model.dtype)
    outliers = outliers_for(spec.head_dim)
    if "kvquant3" in (k_dtype, v_dtype):
        books = codebooks_for(model, tokenizer)
    key = KVQuantKeyCodec(books.keys, outliers) if k_dtype == "kvquant3" else key_codec(k_dtype)
    value = KVQuantValueCodec(books.values, outliers) if v_dtype == "kvquant3" else value_codec(v_dtype)
    return QuantizedCache(spec, capacity, max_capacity, key, value, residual, key_rope=_key_rope(model))

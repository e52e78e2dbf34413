"""kvquant3 calibration: the per-layer codebooks of kv/kvquant.py fit on the model's own keys and
values over a calibration text (a forward and, where the weights allow, a backward pass for Fisher
weights), cached per model on disk. Lives above kv/ and models/ because it runs the model.
"""

from __future__ import annotations

import hashlib
import os
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvgen.kv.codecs import BLOCK_TOKENS, CHANNEL_GROUP
from kvgen.kv.interface import CacheSpec, KVCache
from kvgen.kv.kvquant import Codebooks, normalise, weighted_kmeans
from kvgen.models.base import DecoderLM
from kvgen.models.rotary import rotate_half

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


def key_rope_of(model: DecoderLM) -> Any:
    """(layer, positions [N]) -> cos, sin [N, D] of the bare rotation, which caches storing keys
    before RoPE apply both ways: a stored key keeps YaRN's attention factor, as the forward's does."""

    def rope(layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = model.rope_for(layer).turns(positions[None])  # [1, N, D]
        return cos[0], sin[0]

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
    rope, positions = key_rope_of(model), torch.arange(len(ids))
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
        _, _, normalised = normalise(grouped, dim=-1)
        value_books.append(_fit(normalised, value_weight))
    return Codebooks(torch.stack(key_books), torch.stack(value_books), weighting)


def _key_blocks(keys: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibration keys [H, T, D] cut into blocks of BLOCK_TOKENS positions (what the codec packs),
    each channel normalised over its block; the weights cut the same way."""
    heads, tokens, dim = keys.shape
    block = min(BLOCK_TOKENS, tokens)
    whole = tokens // block * block
    _, _, normalised = normalise(keys[:, :whole].reshape(heads, -1, block, dim), dim=2)
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
    table = model.embed_tokens  # a float table or a quantized one (models/embedding.py): every 97th row
    sample = table[torch.arange(0, getattr(table, "num_embeddings", None) or table.shape[0], 97)]
    for tensor in (sample, model.norm.weight.data):
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

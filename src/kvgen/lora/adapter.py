"""LoraAdapter: one adapter's A/B per (layer, projection), checked against the model it will run on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvgen.config import ModelConfig
from kvgen.errors import KvgenError
from kvgen.models.lora import MODULE_OF, LoraWeights

PROJECTIONS = tuple(MODULE_OF)  # q, k, v, o, gate, up, down


class AdapterError(KvgenError, ValueError):
    """An adapter file that cannot be read, or that does not fit the loaded model."""


class UnknownAdapterError(KvgenError, LookupError):
    """A request names an adapter that is not loaded (the server answers 404)."""


@dataclass
class LoraAdapter:
    name: str
    path: Path
    weights: LoraWeights  # (layer, projection) -> (A [r, in], B [out, r] * scaling), fp32
    rank: int  # the largest rank over its projections
    projections: tuple[str, ...]  # which of q/k/v/o/gate/up/down it changes

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """projection -> (out, in) of the base linear it adds to."""
    q, kv, hidden, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.hidden_size, config.intermediate_size
    return {"q": (q, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, q),
            "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}  # fmt: skip


def build_adapter(
    name: str, path: Path, pairs: dict[tuple[int, str], dict[str, torch.Tensor]], scalings: dict[tuple[int, str], float],
    config: ModelConfig,
) -> LoraAdapter:  # fmt: skip
    """pairs[(layer, proj)] = {"A": [r, in], "B": [out, r]} -> a checked LoraAdapter (scaling folded into B).
    AdapterError names the first tensor that is missing or whose shape does not fit `config`."""
    if not pairs:
        raise AdapterError(f"{path} holds no LoRA weights for q/k/v/o/gate/up/down projections")
    shapes = projection_shapes(config)
    weights: LoraWeights = {}
    for (layer, proj), pair in sorted(pairs.items()):
        where = f"layer {layer} {proj}_proj"
        if not 0 <= layer < config.num_layers:
            raise AdapterError(f"{path}: {where} is past the model's {config.num_layers} layers: the adapter was made for another base model")
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{path}: {where} has lora_{next(iter(pair))} but not its partner: the file is damaged")
        a, b = pair["A"].float(), pair["B"].float()
        out_features, in_features = shapes[proj]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, rank):
            raise AdapterError(
                f"{path}: {where} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, but this model needs "
                f"[r, {in_features}] and [{out_features}, r]: the adapter was made for another base model"
            )  # fmt: skip
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{path}: {where} holds NaN or infinite values: the file is damaged")
        weights[layer, proj] = (a.contiguous(), (b * scalings[layer, proj]).contiguous())
    rank = max(a.shape[0] for a, _ in weights.values())
    projections = tuple(p for p in PROJECTIONS if any(proj == p for _, proj in weights))
    return LoraAdapter(name, path, weights, rank, projections)


def rank_scaling(alpha: float, rank: int, rslora: bool) -> float:
    """PEFT's LoRA scaling: alpha / r, or alpha / sqrt(r) for rank-stabilized LoRA."""
    return alpha / rank**0.5 if rslora else alpha / rank

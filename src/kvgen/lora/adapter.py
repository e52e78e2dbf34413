"""LoraAdapter: one adapter's A/B per (layer, projection), checked against the model it will run on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvgen.config import HybridConfig, ModelConfig, ShortConvConfig
from kvgen.errors import KvgenError
from kvgen.loading.falcon_h1 import projection_row_scales
from kvgen.models.lora import MODULE_OF, LoraWeights

PROJECTIONS = tuple(MODULE_OF)  # q, k, v, o, gate, up, down, and a hybrid's mixer_in, mixer_out


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


def projection_shapes(config: ModelConfig | HybridConfig, layer: int) -> dict[str, tuple[int, int]]:
    """projection -> (out, in) of the base linear it adds to, for each projection layer `layer` has.
    A hybrid's layer has attention's q/k/v/o where it attends, its mixer's in and out projections
    where it keeps a state, and the MLP's where it runs a dense one (gate only where gated)."""
    decoder = config.decoder if isinstance(config, HybridConfig) else config
    q, kv, hidden = decoder.num_heads * decoder.head_dim, decoder.num_kv_heads * decoder.head_dim, decoder.hidden_size
    inter = decoder.intermediate_size
    attention = {"q": (q, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, q)}
    mlp = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    if not isinstance(config, HybridConfig):
        return attention | mlp
    shapes = attention if layer in config.attention_layers else {}
    if layer in config.state_layers:
        mixer = config.mixer
        inner = mixer.hidden_size if isinstance(mixer, ShortConvConfig) else mixer.intermediate_size
        rows = 3 * inner if isinstance(mixer, ShortConvConfig) else inner + mixer.conv_dim + mixer.num_heads  # B, C, x / z, xBC, dt
        shapes = shapes | {"mixer_in": (rows, hidden), "mixer_out": (hidden, inner)}
    if config.has_mlp(layer) and not (decoder.num_experts and layer in decoder.moe_layers):
        shapes = shapes | {p: mlp[p] for p in (("up", "down") if decoder.hidden_act == "relu2" else mlp)}
    return shapes


def build_adapter(
    name: str, path: Path, pairs: dict[tuple[int, str], dict[str, torch.Tensor]], scalings: dict[tuple[int, str], float],
    config: ModelConfig | HybridConfig,
) -> LoraAdapter:  # fmt: skip
    """pairs[(layer, proj)] = {"A": [r, in], "B": [out, r]} -> a checked LoraAdapter (scaling folded into B).
    AdapterError names the first tensor that is missing or whose shape does not fit `config`."""
    if not pairs:
        raise AdapterError(f"{path} holds no LoRA weights for q/k/v/o/gate/up/down projections")
    num_layers = config.decoder.num_layers if isinstance(config, HybridConfig) else config.num_layers
    weights: LoraWeights = {}
    folds = projection_row_scales(config) if isinstance(config, HybridConfig) and config.folded_multipliers else {}
    for (layer, proj), pair in sorted(pairs.items()):
        where = f"layer {layer} {proj if proj.startswith('mixer') else proj + '_proj'}"
        if not 0 <= layer < num_layers:
            raise AdapterError(f"{path}: {where} is past the model's {num_layers} layers: the adapter was made for another base model")
        shapes = projection_shapes(config, layer)
        if proj in ("gate", "up", "down") and layer in _mixture_layers(config):
            raise mixture_mlp_error(name, layer)
        if proj not in shapes:
            kind = config.layer_types[layer] if isinstance(config, HybridConfig) else "dense"
            raise AdapterError(f"{path}: {where}: layer {layer} is a {kind} layer without that projection (it has "
                               f"{', '.join(shapes) or 'none LoRA reaches'}): the adapter was made for another base model")  # fmt: skip
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
        if proj in folds:  # as the loader folded the base weight
            b = b * (folds[proj][:, None] if folds[proj].dim() else folds[proj])
        weights[layer, proj] = (a.contiguous(), (b * scalings[layer, proj]).contiguous())
    rank = max(a.shape[0] for a, _ in weights.values())
    projections = tuple(p for p in PROJECTIONS if any(proj == p for _, proj in weights))
    return LoraAdapter(name, path, weights, rank, projections)


def _mixture_layers(config: ModelConfig | HybridConfig) -> tuple[int, ...]:
    decoder = config.decoder if isinstance(config, HybridConfig) else config
    return tuple(decoder.moe_layers) if decoder.num_experts else ()


def mixture_mlp_error(name: str, layer: int) -> AdapterError:
    """The refusal of an adapter that changes a mixture of experts' MLP (its experts or shared expert)."""
    return AdapterError(f"adapter {name!r} changes the MLP of layer {layer}, a mixture of experts: kvgen applies "
                        "LoRA to a mixture's attention (q, k, v, o) and to dense layers' MLPs; train it without MLP targets "
                        "on those layers")  # fmt: skip


def rank_scaling(alpha: float, rank: int, rslora: bool) -> float:
    """PEFT's LoRA scaling: alpha / r, or alpha / sqrt(r) for rank-stabilized LoRA."""
    return alpha / rank**0.5 if rslora else alpha / rank

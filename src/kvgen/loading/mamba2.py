"""Mamba-2 HF folders (`Mamba2ForCausalLM`, model_type "mamba2"): config.json -> Mamba2Config, and
the tensor names other exporters use -> transformers' names.

What transformers 5 runs is what kvgen runs: the gated RMSNorm multiplies by silu(z) *before*
normalising each of the n_groups groups of channels (mamba_ssm's norm_before_gate=False), and dt is
clamped to `time_step_limit` only in its chunked prefill, never in its decode step, so only the
no-op limit (0, inf) is taken. Configs asking for something transformers does not run are refused
by name rather than run differently from the reference.

`norm_before_gate: true` is the exception, read and ignored as transformers does: transformers 4.44
wrote it as its config default (Mamba-Codestral-7B's config.json carries it), its torch path never
read it, and mamba_ssm, which trained those weights, gates first.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvgen.config import Mamba2Config
from kvgen.errors import ModelLoadError, UnsupportedModelError
from kvgen.kernels.formats import QuantizedWeight


def mamba2_config(raw: dict[str, Any]) -> Mamba2Config:
    refuse_unhonoured(raw)
    try:
        hidden, heads, head_dim = int(raw["hidden_size"]), int(raw["num_heads"]), int(raw["head_dim"])
        intermediate = int(raw.get("intermediate_size") or int(raw.get("expand", 2)) * hidden)
        if intermediate != heads * head_dim:
            raise ModelLoadError(f"config.json's expand x hidden_size ({intermediate}) must equal num_heads x head_dim "
                                 f"({heads} x {head_dim}); it is not a consistent mamba2 config")  # fmt: skip
        return Mamba2Config(
            vocab_size=int(raw["vocab_size"]), hidden_size=hidden, num_heads=heads, head_dim=head_dim,
            n_groups=int(raw.get("n_groups", 8)), state_size=int(raw["state_size"]), conv_kernel=int(raw.get("conv_kernel", 4)),
            num_layers=int(raw["num_hidden_layers"]), rms_norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
            chunk_size=int(raw.get("chunk_size", 256)), tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            use_conv_bias=bool(raw.get("use_conv_bias", True)), use_bias=bool(raw.get("use_bias", False)),
        )  # fmt: skip
    except KeyError as error:
        raise ModelLoadError(f"config.json lacks {error}; it is not a complete mamba2 config") from error
    except ValueError as error:  # Mamba2Config's own checks
        if isinstance(error, ModelLoadError):
            raise
        raise ModelLoadError(f"config.json is not a valid mamba2 config: {error}") from error


def refuse_unhonoured(raw: dict[str, Any]) -> None:
    """Settings transformers' Mamba2 ignores or runs inconsistently: refused, not guessed at."""
    low, high = (_number(v) for v in raw.get("time_step_limit") or (0.0, math.inf))
    if low > 0 or not math.isinf(high):
        raise UnsupportedModelError(f"time_step_limit {[low, high]} is not supported: kvgen runs Mamba-2 with dt unclamped, "
                                    "time_step_limit (0.0, inf); transformers clamps dt in prefill only")  # fmt: skip
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {raw['hidden_act']!r} is not supported: Mamba-2's convolution runs SiLU")
    for key in ("rms_norm", "rmsnorm"):
        if raw.get(key) is False:
            raise UnsupportedModelError(f"{key}: false (no norm before out_proj) is not supported: kvgen runs Mamba-2 as "
                                        "transformers does, with the gated RMSNorm")  # fmt: skip


def _number(value: Any) -> float:
    """A config number; transformers 5 writes infinities as {"__float__": "Infinity"}, older ones as Infinity."""
    return float(value["__float__"] if isinstance(value, dict) else value)


_PREFIXES = ("model.backbone.", "model.lm_head.")  # some exporters nest the model one level deeper
_ALIASES = {"backbone.embedding.weight": "backbone.embeddings.weight"}  # mamba_ssm's name (transformers renames it too)


def name_mamba2_weights(tensors: dict[str, torch.Tensor | QuantizedWeight]) -> None:
    """In place: tensors under transformers' names (backbone.*, lm_head.weight)."""
    for name in list(tensors):
        new = name[len("model.") :] if name.startswith(_PREFIXES) else name
        new = _ALIASES.get(new, new)
        if new != name:
            tensors[new] = tensors.pop(name)

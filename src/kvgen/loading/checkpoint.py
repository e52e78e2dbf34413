"""What a loader hands to the model builder: config, weights under Hugging Face names, tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

import numpy as np

from kvgen.config import ModelConfig
from kvgen.errors import ModelLoadError
from kvgen.kernels.formats import QuantizedWeight
from kvgen.loading.tokenizer import Tokenizer
from kvgen.models.half_linear import HalfWeight

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class Checkpoint:
    config: ModelConfig
    # Weights use Hugging Face parameter names and conventions (e.g. Gemma norms store w, not 1 + w),
    # so a checkpoint from either format builds the same model.
    # Matmul weights may instead be QuantizedWeight blocks, or HalfWeight values kept 16-bit (see
    # loading/weight_format.py).
    tensors: dict[str, torch.Tensor | QuantizedWeight | HalfWeight]
    tokenizer: Tokenizer
    path: Path
    format: str  # "gguf" or "hf"
    weights: str = "fp32"  # the resolved weight mode: fp32, 16bit, int8 or q4


def check_finite(name: str, tensor: torch.Tensor | QuantizedWeight | HalfWeight, path: Path) -> None:
    """Corrupted quantized blocks usually decode to inf/NaN scales; catch that at load, not as garbage text."""
    if isinstance(tensor, HalfWeight):
        tensor = tensor.values
    if isinstance(tensor, QuantizedWeight):
        if not np.isfinite(tensor.scales()).all():
            raise ModelLoadError(
                f"tensor {name!r} in {path} has NaN or infinite block scales: the file is corrupted; "
                "download or convert it again"
            )
        return
    # One reduction first (NaN/inf propagate through a sum); the exact scan only if that trips.
    if not tensor.is_floating_point() or bool(torch.isfinite(tensor.sum(dtype=torch.float64))):
        return
    if not bool(torch.isfinite(tensor).all()):
        raise ModelLoadError(
            f"tensor {name!r} in {path} contains NaN or infinite values: the file is corrupted; "
            "download or convert it again"
        )

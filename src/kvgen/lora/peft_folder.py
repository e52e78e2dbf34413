"""PEFT LoRA folders (adapter_config.json + adapter_model.safetensors) -> LoraAdapter.

Scaling follows PEFT: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora; rank_pattern and
alpha_pattern override r and alpha for the modules whose name they match (PEFT's `get_pattern_key`).
What kvgen cannot apply (DoRA, LoRA biases, modules_to_save, embedding or head targets) is refused
by name rather than silently ignored.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvgen.config import ModelConfig
from kvgen.lora.adapter import AdapterError, LoraAdapter, build_adapter, rank_scaling

_KEY = re.compile(r"^(?:.*\.)?(layers\.(\d+)\.(\w+\.\w+))\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# A layer's module -> the projections its LoRA changes (two: Granite 4.0-H's fused gate|up, gate rows first)
_MODULES: dict[str, tuple[str, ...]] = {
    **{f"{parent}.{p}_proj": (p,) for parent in ("self_attn", "mlp") for p in ("q", "k", "v", "o", "gate", "up", "down")},
    "self_attn.out_proj": ("o",),  # LFM2
    "feed_forward.w1": ("gate",), "feed_forward.w3": ("up",), "feed_forward.w2": ("down",),  # LFM2
    **{f"feed_forward.{p}_proj": (p,) for p in ("gate", "up", "down")},  # Bamba
    "shared_mlp.input_linear": ("gate", "up"), "shared_mlp.output_linear": ("down",),  # Granite 4.0-H
    **{f"mixer.{p}_proj": (p,) for p in ("q", "k", "v", "o", "up", "down")},  # Nemotron-H's attention and MLP layers
    **{f"{mixer}.in_proj": ("mixer_in",) for mixer in ("mamba", "mixer", "conv")},  # Mamba-2 (Granite, Nemotron-H), LFM2's conv
    **{f"{mixer}.out_proj": ("mixer_out",) for mixer in ("mamba", "mixer", "conv")},
}  # fmt: skip
_SUPPORTED_TARGETS = {module.split(".")[1] for module in _MODULES}


def is_peft_folder(path: Path) -> bool:
    return path.is_dir() and (path / "adapter_config.json").is_file()


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


def _check_config(config: dict[str, Any], path: Path) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path} is a {config.get('peft_type')} adapter; kvgen loads LoRA adapters only")
    refused = {
        "use_dora": "DoRA", "lora_bias": "LoRA biases", "fan_in_fan_out": "fan_in_fan_out (Conv1D bases)",
    }  # fmt: skip
    for key, what in refused.items():
        if config.get(key):
            raise AdapterError(f"{path}: {key} is set; kvgen does not apply {what}: train the adapter without it")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{path}: bias={config['bias']!r} trains base biases, which kvgen does not load: use bias='none'")
    if config.get("modules_to_save"):
        raise AdapterError(f"{path}: modules_to_save {config['modules_to_save']} replaces whole modules, which kvgen does not do")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unsupported = sorted(set(targets) - _SUPPORTED_TARGETS)
        if unsupported:
            raise AdapterError(f"{path}: target modules {unsupported} are not supported; kvgen applies LoRA to {sorted(_SUPPORTED_TARGETS)}")


def load_peft_folder(name: str, path: Path, model_config: ModelConfig) -> LoraAdapter:
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise AdapterError(f"{path / 'adapter_config.json'} cannot be read as JSON: {error}") from error
    _check_config(config, path)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise AdapterError(f"{path} has no adapter_model.safetensors (save the adapter with safe_serialization=True)")
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as error:
        raise AdapterError(f"{weights_file} is not a readable safetensors file (damaged?): {error}") from error
    rank, alpha, rslora = config.get("r", 8), config.get("lora_alpha", 8), bool(config.get("use_rslora", False))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    scalings: dict[tuple[int, str], float] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match.group(3) not in _MODULES:
            raise AdapterError(f"{weights_file}: tensor {key!r} is not a LoRA A/B of a projection kvgen applies LoRA to (attention's, "
                               "a dense MLP's, a Mamba-2 or short-conv mixer's in_proj / out_proj); kvgen cannot apply it")  # fmt: skip
        module, layer, projections, side = match.group(1), int(match.group(2)), _MODULES[match.group(3)], match.group(4)
        for part, proj in enumerate(projections):  # a fused module's B splits by rows; its A is each part's
            rows = tensor.shape[0] // len(projections)
            pairs.setdefault((layer, proj), {})[side] = tensor if side == "A" else tensor[part * rows : (part + 1) * rows]
        module_rank = _pattern_value(config.get("rank_pattern") or {}, module, rank)
        module_alpha = _pattern_value(config.get("alpha_pattern") or {}, module, alpha)
        if side == "A" and tensor.shape[0] != module_rank:
            raise AdapterError(f"{weights_file}: {key} has rank {tensor.shape[0]} but the config says r={module_rank}: the files do not match")
        for proj in projections:
            scalings[layer, proj] = rank_scaling(float(module_alpha), int(module_rank), rslora)
    return build_adapter(name, path, pairs, scalings, model_config)

"""llama.cpp GGUF LoRA files (general.type = adapter, adapter.type = lora) -> LoraAdapter, and back.

The layout is llama.cpp's convert_lora_to_gguf.py: per projection `blk.N.<name>.weight.lora_a`
[r, in] and `.lora_b` [out, r] (numpy order), scale = adapter.lora.alpha / r (1 when alpha is 0,
as llama.cpp does). Where the converter permutes Q's and K's rows (Llama, Mixtral, Granite 4.0-H,
Nemotron-H: gguf.py's `permuted_qk_heads`), lora_b of Q and K has the same permutation, undone here
as the base loader does for the weights.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from kvgen.config import HybridConfig, ModelConfig, ShortConvConfig
from kvgen.errors import ModelLoadError
from kvgen.lora.adapter import AdapterError, LoraAdapter, build_adapter
from kvgen.loading.gguf import permuted_qk_heads, unpermute_qk
from kvgen.loading.gguf_file import GGUFFile

GGUF_PROJECTIONS = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down",
                    "ssm_in": "mixer_in", "ssm_out": "mixer_out",  # Mamba-2 mixers (Granite 4.0-H, Nemotron-H)
                    "shortconv.in_proj": "mixer_in", "shortconv.out_proj": "mixer_out"}  # LFM2's short convs; fmt: skip
_NAME = re.compile(r"^blk\.(\d+)\.([\w.]+)\.weight\.lora_([ab])$")
# llama.cpp's architecture names where kvgen's config calls the family otherwise
_KVGEN_ARCHITECTURE = {"granitehybrid": "granitemoehybrid", "lfm2moe": "lfm2", "nemotron_h_moe": "nemotron_h", "falcon-h1": "falcon_h1"}


def is_gguf_lora(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def load_gguf_lora(name: str, path: Path, config: ModelConfig | HybridConfig) -> LoraAdapter:
    import gguf

    try:
        file = GGUFFile(path)
    except ModelLoadError as error:
        raise AdapterError(f"{path} cannot be read as a GGUF LoRA adapter: {error}") from error
    meta = file.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise AdapterError(f"{path} is not a GGUF LoRA adapter (general.type={meta.get('general.type')!r}, "
                           f"adapter.type={meta.get('adapter.type')!r}; expected 'adapter' and 'lora')")  # fmt: skip
    arch = meta.get("general.architecture")
    if _KVGEN_ARCHITECTURE.get(arch, arch) != config.architecture:
        raise AdapterError(f"{path} is a LoRA for {arch!r} models, but the loaded model is {config.architecture!r}")
    alpha = float(meta.get("adapter.lora.alpha", 0.0))
    heads = permuted_qk_heads(config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    scalings: dict[tuple[int, str], float] = {}
    for tensor_name, info in file.tensors.items():
        match = _NAME.match(tensor_name)
        if match is None or match.group(2) not in GGUF_PROJECTIONS:
            raise AdapterError(f"{path}: tensor {tensor_name!r} is not a LoRA of a projection kvgen applies LoRA to "
                               f"({', '.join(GGUF_PROJECTIONS)}); kvgen cannot apply it")  # fmt: skip
        layer, proj, side = int(match.group(1)), GGUF_PROJECTIONS[match.group(2)], match.group(3).upper()
        array = np.array(gguf.quants.dequantize(file.raw(info), gguf.GGMLQuantizationType(info.type_id)), dtype=np.float32)
        if side == "B" and heads is not None and proj in ("q", "k"):
            array = unpermute_qk(array, heads[0] if proj == "q" else heads[1])
        pairs.setdefault((layer, proj), {})[side] = torch.from_numpy(array)
        if side == "A":
            scalings[layer, proj] = alpha / array.shape[0] if alpha else 1.0
    return build_adapter(name, path, pairs, scalings, config)


def write_gguf_lora(adapter: LoraAdapter, config: ModelConfig | HybridConfig, path: Path, alpha: float, arch: str | None = None) -> None:
    """Write `adapter` in llama.cpp's GGUF LoRA layout (F32), for llama.cpp's architecture `arch`
    (None: the config's). Its B holds the scaling already, so it is divided back by alpha / r:
    llama.cpp multiplies by it again."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch or config.architecture)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    short_conv = isinstance(config, HybridConfig) and isinstance(config.mixer, ShortConvConfig)
    heads = permuted_qk_heads(config)
    names = {proj: gguf_name for gguf_name, proj in GGUF_PROJECTIONS.items() if gguf_name.startswith("shortconv") == short_conv or "mixer" not in proj}
    for (layer, proj), (a, b) in sorted(adapter.weights.items()):
        b = b / (alpha / a.shape[0])
        b_array = b.numpy()
        if heads is not None and proj in ("q", "k"):
            b_array = _permute_qk(b_array, heads[0] if proj == "q" else heads[1])
        writer.add_tensor(f"blk.{layer}.{names[proj]}.weight.lora_a", np.ascontiguousarray(a.numpy(), dtype=np.float32))
        writer.add_tensor(f"blk.{layer}.{names[proj]}.weight.lora_b", np.ascontiguousarray(b_array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _permute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (HF rotate-half halves -> interleaved pairs); unpermute_qk undoes it."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)

"""Models with a real model's architecture, shapes and tokenizer but random weights that transformers
draws, saved as HF folders: what a GPU machine without the weights (or without internet) runs.

The architecture comes from the installed GGUF (config and tokenizer as transformers reads them),
or from a folder of those files (`KVGEN_MODEL_SHAPES`, one sub-folder per model name) where the
GGUF is not installed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

SHAPES_ENV = "KVGEN_MODEL_SHAPES"
# Shapes that no shipped model has, derived from one that is (the tokenizer stays the source's).
DERIVED: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama 3.2 1B's block shapes (16 layers of 2048, GQA 32/8, MLP 8192) over SmolLM2's vocabulary.
    "llama-1b-shape": ("smollm2", {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64}),
}  # fmt: skip


def shape_folder(name: str, folder: Path) -> Path:
    """`name`'s config.json and tokenizer files in `folder` (from KVGEN_MODEL_SHAPES or the GGUF)."""
    source, overrides = DERIVED.get(name, (name, {}))
    folder.mkdir(parents=True, exist_ok=True)
    shapes = os.environ.get(SHAPES_ENV)
    if shapes:
        for file in (Path(shapes) / source).iterdir():
            shutil.copy(file, folder / file.name)
    else:
        from transformers import AutoConfig, AutoTokenizer

        from tests.support.models import model_path

        path = model_path(source)
        AutoConfig.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(folder)
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(folder)
    if overrides:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(folder)
        for key, value in overrides.items():
            setattr(config, key, value)
        config.save_pretrained(folder)
    return folder


def save_random_like(name: str, folder: Path, seed: int = 0) -> Any:
    """`name`'s architecture with transformers' own random init (seeded), saved in fp32 as an HF
    folder with the tokenizer -> the transformers model (fp32, on the CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape_folder(name, folder)
    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    return model

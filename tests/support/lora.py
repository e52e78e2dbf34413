"""LoRA adapters made by peft on the transformers reference, with peft's own outputs to compare to."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.conftest import load_reference

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class PeftAdapter:
    path: Path
    prompt_ids: list[int]
    logits: torch.Tensor  # [S, V] peft's logits over the prompt
    greedy: list[int]  # peft's greedy continuation of the prompt


def make_peft_adapter(
    model_name: str, path: Path, prompt: str, rank: int, targets: list[str], alpha: float, rslora: bool = False,
    seed: int = 0, new_tokens: int = 12,
) -> PeftAdapter:  # fmt: skip
    """A random, non-zero LoRA (init_lora_weights=False) saved by peft at `path`, and peft's logits
    and greedy tokens with it. The reference model is given back unchanged (peft's layers unloaded)."""
    from peft import LoraConfig, get_peft_model

    model, tokenizer = load_reference(model_name)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, use_rslora=rslora)
    peft_model = get_peft_model(model, config)
    # Random init gives deltas far larger than trained ones; scale B down so the text stays natural.
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.05)
    try:
        peft_model.save_pretrained(str(path))
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            logits = peft_model(ids).logits[0]
            out = peft_model.generate(ids, max_new_tokens=new_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
    finally:
        peft_model.unload()  # the shared reference model loses its LoRA layers again
    return PeftAdapter(path, ids[0].tolist(), logits, out[0, ids.shape[1] :].tolist())


def save_halved_peft_adapter(model: Any, path: Path, prompt: list[int], seed: int, **settings: Any) -> tuple[Any, torch.Tensor]:
    """A random LoRA that peft makes on `model` (`settings`: LoraConfig's, init_lora_weights=False,
    B halved so the deltas stay moderate), saved at `path`: peft's logits over `prompt` [S, V] and
    the model with peft's layers unloaded again."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(**{"init_lora_weights": False, **settings}))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(0.5)
        logits = peft_model(torch.tensor([prompt])).logits[0]
    peft_model.save_pretrained(str(path))
    return peft_model.unload(), logits

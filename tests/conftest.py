"""Session-wide fixtures: the real models, loaded once, and their transformers references."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvgen import LLM
from tests.support.models import model_path

MODEL_NAMES = ("smollm2", "gemma3-270m")
_llms: dict[str, LLM] = {}
_references: dict[str, Any] = {}


def load_llm(name: str) -> LLM:
    if name not in _llms:
        _llms[name] = LLM.load(model_path(name), progress=False, weights="fp32")  # the exact reference path
    return _llms[name]


def load_reference(name: str) -> tuple[Any, Any]:
    """transformers' model and tokenizer on the very same GGUF file (dequantized to fp32)."""
    if name not in _references:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = model_path(name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        _references[name] = (model, tokenizer)
    return _references[name]


@pytest.fixture(scope="session")
def smollm2() -> LLM:
    return load_llm("smollm2")


@pytest.fixture(scope="session")
def gemma3() -> LLM:
    return load_llm("gemma3-270m")


@pytest.fixture(scope="session")
def smollm2_q4() -> LLM:
    """SmolLM2 with 4-bit weights: a real draft model with different weights and the same tokenizer."""
    return LLM.load(model_path("smollm2"), progress=False, weights="q4")

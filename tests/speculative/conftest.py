"""Speculative tests share the target's plain greedy outputs (the reference) and the q4 draft model."""

from __future__ import annotations

import pytest

from kvgen import LLM
from tests.support.models import model_path

_q4: dict[str, LLM] = {}


@pytest.fixture(scope="session")
def smollm2_q4() -> LLM:
    """SmolLM2 with 4-bit weights: a real draft with different weights and the same tokenizer."""
    if "smollm2" not in _q4:
        _q4["smollm2"] = LLM.load(model_path("smollm2"), progress=False, weights="q4")
    return _q4["smollm2"]

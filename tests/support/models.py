"""Locating the real models the tests run (installed by `make models`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgen.errors import ModelLoadError
from kvgen.loading.registry import resolve_model_path


def model_path(name: str) -> Path:
    """Path of a shipped model, or skip the test with the command that installs it."""
    try:
        return resolve_model_path(name)
    except ModelLoadError as error:
        pytest.skip(str(error))


PROMPTS = [
    "Once upon a time, there was a little girl who",
    "The three primary colors are",
    "def fibonacci(n):\n    ",
    "In a distant galaxy, the starship",
    # SmolLM2's argmax after this one is EOS: checks that both engines stop at once.
    "Question: What is the capital of France?\nAnswer:",
]

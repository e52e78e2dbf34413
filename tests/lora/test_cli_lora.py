"""`kvgen generate --lora PATH`: the adapter's greedy continuation (peft's, on fp32 weights), and a
clear one-line error for an adapter that does not fit the model."""

from __future__ import annotations

import pytest

from tests.cli.test_cli import assert_one_line_error, kvgen
from tests.lora.conftest import PROMPT, peft_adapters
from tests.support.models import model_path


@pytest.mark.slow
def test_generate_with_lora_prints_peft_greedy_text(lora_dir, smollm2) -> None:
    adapter = peft_adapters("smollm2", lora_dir)["qv-r4"]
    n = len(adapter.greedy)
    result = kvgen("generate", PROMPT, "--model", str(model_path("smollm2")), "--weights", "fp32", "--lora", str(adapter.path),
                   "-n", str(n), "--no-progress")  # fmt: skip
    assert result.returncode == 0, result.stderr
    expected = smollm2.tokenizer.decode(adapter.greedy)
    assert result.stdout.rstrip("\n") == PROMPT + expected


@pytest.mark.slow
def test_generate_with_an_adapter_for_another_model_is_one_line_error(lora_dir) -> None:
    adapter = peft_adapters("smollm2", lora_dir)["qv-r4"]
    result = kvgen("generate", "hi", "--model", str(model_path("gemma3-270m")), "--lora", str(adapter.path), "--no-progress")
    assert_one_line_error(result, "adapter")

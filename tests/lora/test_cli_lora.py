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


def test_serve_refuses_bad_lora_specs_before_loading_the_model(tmp_path) -> None:
    """Each a one-line error naming --lora, exit status 2, before the model is read."""
    real = str(tmp_path)
    for spec, pattern in [("no-equals-sign", "--lora 'no-equals-sign': give NAME=PATH"), (f"={real}", "give NAME=PATH"),
                          ("name=", "give NAME=PATH"), ("a=/no/such/adapter", "no such file or folder"),
                          ("smollm2=" + real, "the base model's name")]:  # fmt: skip
        assert_one_line_error(kvgen("serve", "smollm2", "--no-progress", "--lora", spec), pattern)
    assert_one_line_error(kvgen("serve", "smollm2", "--no-progress", "--lora", f"a={real}", "--lora", f"a={real}"), "given twice")
    assert_one_line_error(kvgen("serve", "smollm2", "--no-progress", "--lora-budget-mb", "0"), "--lora-budget-mb must be a positive")


@pytest.mark.slow
def test_serve_with_a_file_that_is_no_adapter_exits_2(tmp_path) -> None:
    """Found only once the model is loaded: still one line naming the flag, and no server starts."""
    (tmp_path / "notes.txt").write_text("not an adapter")
    result = kvgen("serve", str(model_path("smollm2")), "--weights", "fp32", "--no-progress", "--port", "9", "--lora", f"x={tmp_path / 'notes.txt'}")
    assert_one_line_error(result, r"--lora x=.*notes.txt: no LoRA adapter at")

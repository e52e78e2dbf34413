"""`--speculative` on the command line: same greedy text as without it, acceptance in the stats."""

from __future__ import annotations

from pathlib import Path

from tests.cli.test_cli import assert_one_line_error, kvgen
from tests.support.tiny_gguf import write_tiny_gguf


def test_generate_with_prompt_lookup_prints_the_plain_greedy_text(tmp_path: Path) -> None:
    tiny = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    args = ("generate", "abcabcabcabc", "--model", tiny, "--no-progress", "-n", "24")
    plain, speculative = kvgen(*args), kvgen(*args, "--speculative", "lookup")
    assert plain.returncode == 0 and speculative.returncode == 0, speculative.stderr
    assert speculative.stdout == plain.stdout
    assert "draft acceptance" in speculative.stderr


def test_draft_method_without_a_draft_model_is_a_one_line_error(tmp_path: Path) -> None:
    tiny = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    result = kvgen("generate", "hi", "--model", tiny, "--no-progress", "--speculative", "draft")
    assert_one_line_error(result, "needs --draft-model")


def test_draft_alternatives_for_a_method_that_drafts_none_is_a_one_line_error(tmp_path: Path) -> None:
    tiny = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    result = kvgen("generate", "hi", "--model", tiny, "--no-progress", "--speculative", "lookup", "--draft-alternatives", "2")
    assert_one_line_error(result, "draft_alternatives is only used by method 'eagle'")


def test_options_of_another_method_are_one_line_errors(tmp_path: Path) -> None:
    tiny = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    base = ("generate", "hi", "--model", tiny, "--no-progress", "--speculative", "lookup")
    assert_one_line_error(kvgen(*base, "--draft-layers", "2"), "draft_layers is only used by method 'self', not 'lookup'")
    assert_one_line_error(kvgen(*base, "--draft-model", tiny), "--draft-model is only used by --speculative draft, not lookup")


def test_prediction_drafts_by_lookup_and_prints_the_plain_greedy_text(tmp_path: Path) -> None:
    tiny = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    args = ("generate", "abcabcabcabc", "--model", tiny, "--no-progress", "-n", "24")
    plain = kvgen(*args)
    predicted = kvgen(*args, "--prediction", plain.stdout.strip())
    assert plain.returncode == 0 and predicted.returncode == 0, predicted.stderr
    assert predicted.stdout == plain.stdout
    assert "draft acceptance" in predicted.stderr
    assert_one_line_error(kvgen(*args, "--prediction", "abc", "--speculative", "self"),
                          "--prediction drafts by prompt lookup, which --speculative self replaces")  # fmt: skip


def test_speculative_options_without_speculative_are_one_line_errors(tmp_path: Path) -> None:
    tiny = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    base = ("generate", "hi", "--model", tiny, "--no-progress")
    assert_one_line_error(kvgen(*base, "--draft-tokens", "3"), "--draft-tokens is only used with --speculative")
    assert_one_line_error(kvgen(*base, "--draft-weights", "int8"), "--draft-weights is only used with --speculative")
    assert_one_line_error(kvgen(*base, "--speculative", "lookup", "--draft-weights", "int8"),
                          "--draft-weights is only used by --speculative draft, not lookup")  # fmt: skip

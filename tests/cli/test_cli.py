"""The command line, run as a user runs it: a subprocess, its stdout, stderr and exit status."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from tests.support.models import model_path
from tests.support.tiny_gguf import write_tiny_gguf

STATS = re.compile(r"^\[prompt (\d+) tokens(?: \((\d+) cached\))?, generated (\d+) tokens \| prefill [\d.]+ tok/s, decode [\d.]+ tok/s\]$")


def kvgen(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgen", *args], input=stdin, capture_output=True, text=True, timeout=600)


def assert_one_line_error(result: subprocess.CompletedProcess[str], pattern: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvgen: error: ") and re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("cli") / "tiny.gguf")


def test_missing_model_path() -> None:
    assert_one_line_error(kvgen("generate", "hi", "--model", "/no/such.gguf", "--no-progress"), "no model at")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the kernel target is checked with gcc")
def test_a_kernel_target_gcc_does_not_know_is_one_line_error(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGEN_KERNEL_ARCH", "no-such-cpu")
    assert_one_line_error(kvgen("generate", "hi", "--model", str(tiny), "--no-progress"),
                          "KVGEN_KERNEL_ARCH='no-such-cpu' is not a target the C compiler knows")  # fmt: skip


def test_truncated_model(tiny: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[:300])
    assert_one_line_error(kvgen("generate", "hi", "--model", str(cut), "--no-progress"), "truncated")


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "bert.gguf", architecture="bert")
    assert_one_line_error(kvgen("generate", "hi", "--model", str(path), "--no-progress"), "architecture 'bert'")


def test_unsupported_quant_type(tmp_path: Path) -> None:
    Q = gguf.GGMLQuantizationType
    path = write_tiny_gguf(tmp_path / "tq2_0.gguf", weight_type=Q.TQ2_0, hidden=256)
    assert_one_line_error(kvgen("generate", "hi", "--model", str(path), "--no-progress"), "TQ2_0")


def test_prompt_too_long(tiny: Path) -> None:
    assert_one_line_error(kvgen("generate", "y" * 300, "--model", str(tiny), "--no-progress"), "prompt has 300 tokens")


def test_bad_sampling_parameter(tiny: Path) -> None:
    assert_one_line_error(kvgen("generate", "hi", "--model", str(tiny), "--top-p", "1.5"), "top_p must be in")


def test_models_lists_short_names() -> None:
    result = kvgen("models")
    assert result.returncode == 0
    assert "smollm2" in result.stdout and "gemma3-270m" in result.stdout


STORY = "Once upon a time, there was a little girl who"


@pytest.fixture(scope="module")
def default_continuation() -> str:
    """What the library itself generates for STORY with the CLI's defaults (greedy, default weights).
    Computed here, not written down: near-tied logits round differently on AVX2 and AVX-512 kernels."""
    from kvgen import LLM, SamplingParams

    return LLM.load(model_path("smollm2"), progress=False).generate(STORY, SamplingParams(max_new_tokens=12)).text


def test_generate_streams_text_and_ends_with_stats(default_continuation: str) -> None:
    result = kvgen("generate", STORY, "-n", "12", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert result.stdout == STORY + default_continuation + "\n"
    match = STATS.match(result.stderr.strip().splitlines()[-1])
    assert match and match.group(1) == "11" and match.group(3) == "12"


def test_chat_prefills_only_the_new_turn() -> None:
    model_path("smollm2")
    result = kvgen("chat", "-n", "16", "--no-progress", stdin="What is 2+2?\nAnd 3+3?\n")
    assert result.returncode == 0, result.stderr
    stats = [STATS.match(line) for line in result.stderr.splitlines() if line.startswith("[prompt")]
    assert len(stats) == 2 and all(stats)
    first_prompt = int(stats[0].group(1))
    second_prompt, second_cached = int(stats[1].group(1)), int(stats[1].group(2))
    # The second turn reuses the whole first prompt and the answer generated for it.
    assert second_cached >= first_prompt + int(stats[0].group(3)) - 1
    assert second_prompt - second_cached < 20  # only "<|im_end|>\n<|im_start|>user\nAnd 3+3?..." is new


def test_unsupported_schema_feature_is_one_line_error(tiny: Path, tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "array", "uniqueItems": true}')
    assert_one_line_error(kvgen("generate", "hi", "--model", str(tiny), "--json-schema", str(schema)), "uniqueItems")
    assert_one_line_error(kvgen("generate", "hi", "--model", str(tiny), "--grammar", "/no/such.gbnf"), "--grammar file")


def test_generate_with_regex_and_stop(default_continuation: str) -> None:
    model_path("smollm2")
    result = kvgen("generate", "The year the war ended:", "--regex", " [0-9]{4}", "-n", "8", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"The year the war ended: [0-9]{4}\n", result.stdout)
    stop = " " + default_continuation.split(" ")[3]  # a word in the middle of what the model says
    result = kvgen("generate", STORY, "-n", "12", "--stop", stop, "--no-progress")
    assert result.stdout == STORY + default_continuation[: default_continuation.index(stop)] + "\n"
    result = kvgen("generate", STORY, "-n", "12", "--stop", stop, "--include-stop", "--no-progress")
    assert result.stdout == STORY + default_continuation[: default_continuation.index(stop) + len(stop)] + "\n"
    result = kvgen("generate", STORY, "-n", "12", "--include-stop", "--no-progress")
    assert result.returncode == 2 and "--include-stop" in result.stderr and "--stop" in result.stderr


def test_chat_prints_reasoning_on_stderr_and_answers_on_stdout(tmp_path: Path) -> None:
    """Under a template that opens a <think> block, SmolLM2's whole reply is reasoning: it goes to
    stderr, stdout gets only the prompts and an empty answer."""
    model_path("smollm2")
    template = Path(__file__).parents[1] / "replies" / "think_template.jinja"
    result = kvgen("chat", "-n", "8", "--no-progress", "--chat-template-file", str(template), stdin="Hi\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.replace("> ", "").strip() == ""
    reasoning = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith(("[prompt", "kvgen chat"))]
    assert reasoning, result.stderr
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% if %}")
    assert_one_line_error(kvgen("chat", "--no-progress", "--chat-template-file", str(bad), stdin=""), "--chat-template-file .*does not compile")

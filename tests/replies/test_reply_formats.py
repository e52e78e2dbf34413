"""Which reply format a model writes (found from its vocabulary and chat template), what ends its
generation, and the chat-template variables a request may set."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgen.llm import LLM
from kvgen.loading.tokenizer import Tokenizer, end_of_generation_ids
from kvgen.replies import detect_reply_format
from tests.support.tiny_hf import harmony_tokenizer_folder

THINK_TEMPLATE = (Path(__file__).parent / "think_template.jinja").read_text()


@pytest.fixture(scope="module")
def harmony_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_hf_folder(harmony_tokenizer_folder(tmp_path_factory.mktemp("harmony")))


def test_harmony_messages_end_at_return_or_call_not_at_end(harmony_tokenizer: Tokenizer) -> None:
    """gpt-oss ends its analysis message with <|end|> and goes on to the answer: <|end|> must not
    stop generation (it does for Phi-3, whose vocabulary has no <|return|>)."""
    ids = {t: harmony_tokenizer.backend.token_to_id(t) for t in ("<|end|>", "<|return|>", "<|call|>")}
    assert ids["<|end|>"] not in harmony_tokenizer.eos_token_ids
    assert {ids["<|return|>"], ids["<|call|>"]} <= set(harmony_tokenizer.eos_token_ids)
    phi3 = {"<|end|>": 32007, "<|endoftext|>": 32000}
    assert end_of_generation_ids([32000], phi3) == [32000, 32007]
    harmony = {"<|end|>": 7, "<|return|>": 2, "<|call|>": 12, "<|channel|>": 5, "<|message|>": 8}
    assert end_of_generation_ids([2, 7, None], harmony) == [2, 12]  # a file that declares <|end|> as EOT too


def test_formats_are_found_from_the_vocabulary_and_template(harmony_tokenizer: Tokenizer, smollm2: LLM) -> None:
    assert detect_reply_format(harmony_tokenizer) == "harmony"
    assert detect_reply_format(smollm2.tokenizer) == "plain"
    assert detect_reply_format(smollm2.tokenizer.with_chat_template(THINK_TEMPLATE)) == "think"


def test_template_variables_render_and_unread_ones_are_refused(harmony_tokenizer: Tokenizer, smollm2: LLM) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert "Reasoning: low" in harmony_tokenizer.apply_chat_template(messages, reasoning_effort="low")
    assert "Reasoning: medium" in harmony_tokenizer.apply_chat_template(messages)
    think = smollm2.tokenizer.with_chat_template(THINK_TEMPLATE)
    assert think.apply_chat_template(messages).endswith("<think>\n")
    assert think.apply_chat_template(messages, enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="does not use 'reasoning_effort'"):
        smollm2.tokenizer.apply_chat_template(messages, reasoning_effort="low")
    with pytest.raises(ValueError, match="does not compile"):
        smollm2.tokenizer.with_chat_template("{% if %}")
    assert smollm2.tokenizer.chat_template != THINK_TEMPLATE  # with_chat_template made a copy


def test_harmony_template_of_the_tests_writes_the_format(harmony_tokenizer: Tokenizer) -> None:
    """The test template renders what gpt-oss's does for these messages: the tools in the developer
    message, a past call with its reasoning, the tool's result, the generation prompt."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "thinking": "Call it.",
                 "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c", "name": "get_weather"}]  # fmt: skip
    text = harmony_tokenizer.apply_chat_template(messages, tools=tools)
    assert "<|start|>developer<|message|># Tools" in text and "type get_weather" in text
    assert '<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json' in text
    assert text.endswith("<|message|>sunny<|end|><|start|>assistant")

"""The grammar a chat request runs under constrains the answer after the reasoning, never the
reasoning: checked by feeding llguidance the tokens of whole replies."""

from __future__ import annotations

import pytest

from kvgen.llm import LLM
from kvgen.sampling.grammar import GrammarConstraint, StructuredOutput
from kvgen.server.reply_grammar import reply_grammar
from kvgen.server.tools import Tool, make_plan

WEATHER = Tool("get_weather", None, {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'


def accepts(tokenizer, grammar: StructuredOutput, text: str) -> bool:
    """Whether the grammar takes every token of `text` and may end there."""
    constraint = GrammarConstraint.create(grammar, tokenizer)
    return all(constraint.advance(t) for t in tokenizer.encode(text, add_special_tokens=False)) and constraint.matcher.is_accepting()


@pytest.mark.parametrize("text,ok", [
    (CALL, True),
    ("<think>\nThe user wants <tool_call> weather.\n</think>\n\n" + CALL, True),  # a tag inside the reasoning is free text
    ("<think>\nfirst</think>\n<think>again</think>" + CALL, False),  # one block
    ("Some text first " + CALL, False),  # required: calls only
])  # fmt: skip
def test_think_models_reason_before_a_required_call(smollm2: LLM, text: str, ok: bool) -> None:
    grammar = reply_grammar("think", make_plan([WEATHER], "required", None), None)
    assert accepts(smollm2.tokenizer, grammar, text) is ok


def test_a_block_the_prompt_opened_must_close_before_the_answer(smollm2: LLM) -> None:
    grammar = reply_grammar("think", make_plan([], None, None), StructuredOutput.json_object(), starts_in_reasoning=True)
    assert accepts(smollm2.tokenizer, grammar, 'Thinking about {"a":1}...\n</think>\n\n{"a":1}')
    assert not accepts(smollm2.tokenizer, grammar, '{"a":1}')  # the block must be closed first


def test_plain_models_keep_the_answers_own_grammar(smollm2: LLM) -> None:
    plan = make_plan([WEATHER], "auto", None)
    assert reply_grammar("plain", plan, None).grammar == plan.structured().grammar
    assert reply_grammar("plain", make_plan([], None, None), None) is None
    assert reply_grammar("think", make_plan([], None, None), None) is None  # nothing to constrain: no grammar

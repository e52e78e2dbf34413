"""The grammar a chat request's output is generated under, for the reply format the model writes:
tool calls and response_format constrain the answer, never the reasoning before it.

- plain: the answer alone (tools.py's tagged calls, or the response_format's JSON).
- think: an optional `<think>` ... `</think>` block first (or, where the generation prompt opened
  it, the rest of the block), then the answer.
- harmony: an analysis message first (or none), then the answer as a final message (its JSON for a
  response_format; free text beside calls under tool_choice "auto"), or a call as harmony writes
  one: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{arguments}`.
"""

from __future__ import annotations

import json
from typing import Any

from kvgen.replies import ReplyFormat
from kvgen.sampling.grammar import StructuredOutput
from kvgen.server.tools import ToolPlan, compile_rules, json_rule

_THINK_RULES = [
    r'THINK: "<think>" THOUGHT "</think>" /[ \t\n]*/',
    r'REST_OF_THINK: THOUGHT "</think>" /[ \t\n]*/',
    r"THOUGHT: /(.|\n)*/ & ~(/(.|\n)*<\/think>(.|\n)*/)",
]
_HARMONY_RULES = [
    'analysis: <|channel|> "analysis" <|message|> BODY <|end|> <|start|> "assistant"',
    r"BODY: /(.|\n)*/",
]


def reply_grammar(reply_format: ReplyFormat, plan: ToolPlan, answer: StructuredOutput | None,
                  starts_in_reasoning: bool = False, answer_param: str = "response_format") -> StructuredOutput | None:  # fmt: skip
    """The request's grammar, or None when neither tools nor `answer` (the request's `answer_param`,
    JSON) constrain it."""
    if not plan.active and answer is None:
        return None
    if reply_format == "plain":
        return plan.structured() or answer
    if reply_format == "think":
        rules = plan.rules() if plan.active else [f"answer: {_answer_rule(answer)}"]
        start = "start: REST_OF_THINK answer" if starts_in_reasoning else "start: THINK? answer"
        return _compile([start, *rules, *_THINK_RULES], plan, answer_param)
    if plan.active:
        calls = [f'call_{i}: <|channel|> {json.dumps(f"commentary to=functions.{t.name} ")} <|constrain|> "json" <|message|> '
                 f"{json_rule(t.parameters)}" for i, t in enumerate(plan.allowed())]  # fmt: skip
        answer_rule = "final | call" if plan.choice == "auto" else "call"
        rules = [f"answer: {answer_rule}", 'final: <|channel|> "final" <|message|> BODY',
                 "call: " + " | ".join(f"call_{i}" for i in range(len(calls))), *calls]  # fmt: skip
    else:
        rules = [f'answer: <|channel|> "final" <|message|> {_answer_rule(answer)}']
    return _compile(["start: analysis? answer", *rules, *_HARMONY_RULES], plan, answer_param)


def _answer_rule(answer: StructuredOutput | None) -> str:
    assert answer is not None and answer.kind in ("json_schema", "json_object"), "the server's answers are JSON"
    schema: Any = {"type": "object"} if answer.kind == "json_object" else answer.spec
    schema = json.loads(schema) if isinstance(schema, str) else schema
    return f"%json {json.dumps({**schema, 'x-guidance': {'whitespace_flexible': False}})}"


def _compile(lines: list[str], plan: ToolPlan, answer_param: str) -> StructuredOutput:
    if plan.active:
        return compile_rules(lines, "tools", "a tool's parameters schema")
    return compile_rules(lines, answer_param, f"the {answer_param} schema")

"""Structured output through llguidance on SmolLM2: every mode, errors before generation, and the
TokenConstraint interface (mask, advance, rollback, fork) that speculative decoding uses."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvgen import SamplingParams, StructuredOutput
from kvgen.sampling.grammar import GrammarConstraint


def chat_ids(llm, message: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": message}])
    return llm.tokenizer.encode(text, add_special_tokens=False)


def constrained(llm, message: str, output: StructuredOutput, max_new_tokens: int = 48):
    result = llm.generate(chat_ids(llm, message), SamplingParams(max_new_tokens=max_new_tokens, structured=output))
    assert result.finish_reason == "stop", f"truncated: {result.text!r}"
    return result


def test_json_object_mode(smollm2) -> None:
    result = constrained(smollm2, "Give a JSON object with a key 'city' and a key 'size'.", StructuredOutput.json_object(), 64)
    assert isinstance(json.loads(result.text), dict)


def test_regex_mode(smollm2) -> None:
    pattern = r"[0-9]{3}-[0-9]{4}"
    result = constrained(smollm2, "Give a phone number.", StructuredOutput.regex(pattern))
    assert re.fullmatch(pattern, result.text)


def test_lark_grammar_mode(smollm2) -> None:
    grammar = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    result = constrained(smollm2, "Is the sky blue?", StructuredOutput.lark(grammar))
    assert result.text in ("The answer is yes.", "The answer is no.")


def test_gbnf_grammar_mode(smollm2) -> None:
    grammar = 'root ::= "color: " color\ncolor ::= "red" | "green" | "blue"'
    result = constrained(smollm2, "Name a color.", StructuredOutput.gbnf(grammar))
    assert result.text in ("color: red", "color: green", "color: blue")


def test_sampled_output_still_follows_the_grammar(smollm2) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    output = StructuredOutput.json_schema(schema)
    for seed in (1, 2):
        params = SamplingParams(max_new_tokens=24, temperature=1.2, seed=seed, structured=output)
        result = smollm2.generate(chat_ids(smollm2, "Pick a number."), params)
        assert result.finish_reason == "stop"
        assert 0 <= json.loads(result.text)["n"] <= 999


@pytest.mark.parametrize(
    ("schema", "feature"),
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"not": {"type": "string"}}, "not"),
        ({"type": "object", "dependentSchemas": {"a": {}}}, "dependentSchemas"),
        ({"type": "string", "format": "credit-card"}, "credit-card"),
    ],
)
def test_unsupported_schema_feature_is_rejected_naming_it(schema: dict, feature: str) -> None:
    with pytest.raises(ValueError, match=f"json_schema cannot be enforced: .*{re.escape(feature)}"):
        StructuredOutput.json_schema(schema)


def test_bad_specs_are_rejected() -> None:
    with pytest.raises(ValueError, match="kind 'yaml' is unknown"):
        StructuredOutput("yaml", "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the schema is not valid JSON"):
        StructuredOutput.json_schema("{not json")
    with pytest.raises(ValueError, match="regex cannot be enforced"):
        StructuredOutput.regex("[unclosed")
    with pytest.raises(ValueError, match="lark cannot be enforced"):
        StructuredOutput.lark("start: undefined_rule")
    with pytest.raises(ValueError, match="give the gbnf text as a non-empty string"):
        StructuredOutput.gbnf("")


def test_constraint_interface_mask_advance_rollback_fork(smollm2) -> None:
    tokenizer = smollm2.tokenizer
    constraint = GrammarConstraint.create(StructuredOutput.regex("(cat|dog)s?"), tokenizer)
    vocab = smollm2.model.config.vocab_size
    first = constraint.allowed_mask(vocab)
    cat, dog = tokenizer.encode("cat", add_special_tokens=False), tokenizer.encode("dog", add_special_tokens=False)
    assert first.shape == (vocab,) and first[cat[0]] and first[dog[0]]
    assert not first[tokenizer.encode("bird", add_special_tokens=False)[0]]
    assert constraint.advance(cat[0]) and not constraint.is_finished()
    twin = constraint.fork()
    constraint.rollback(1)
    assert torch.equal(constraint.allowed_mask(vocab), first)
    s = tokenizer.encode("s", add_special_tokens=False)[0]
    if len(cat) == 1:  # "cat" is one token: after it only "s" or the end may come
        after = twin.allowed_mask(vocab)
        assert after[s] and int(after.sum()) <= 3
    assert twin.advance(*cat[1:]) if len(cat) > 1 else True


def test_failed_grammar_request_frees_nothing_it_did_not_take(smollm2) -> None:
    with pytest.raises(ValueError, match="cannot be enforced"):
        SamplingParams(structured=StructuredOutput.json_schema({"type": "array", "uniqueItems": True}))

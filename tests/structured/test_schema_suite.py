"""23 real-world JSON schemas generated with SmolLM2 under the grammar: every output parses, validates
with jsonschema (formats included) and ends because the grammar completed, never by the token budget."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvgen import SamplingParams, StructuredOutput
from tests.structured.schemas import SCHEMAS

BUDGET = 160  # far above what any bounded schema here needs


def prompt_ids(llm, request: str, schema: dict) -> list[int]:
    message = f"{request} Answer with JSON only, following this schema: {json.dumps(schema)}"
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": message}])
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_the_suite_is_large_enough() -> None:
    assert len(SCHEMAS) >= 20


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_output_validates(smollm2, name: str) -> None:
    request, schema = SCHEMAS[name]
    params = SamplingParams(max_new_tokens=BUDGET, structured=StructuredOutput.json_schema(schema))
    result = smollm2.generate(prompt_ids(smollm2, request, schema), params)
    assert result.finish_reason == "stop", f"{name}: truncated after {len(result.token_ids)} tokens: {result.text!r}"
    value = json.loads(result.text)
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    errors = [e.message for e in validator.iter_errors(value)]
    assert not errors, f"{name}: {result.text!r} fails: {errors}"

"""Hostile input: over 200 malformed requests (bad JSON, wrong types, huge values, deep nesting, huge
bodies, invalid schemas, bad message shapes, unknown fields, wrong paths and methods) each get a 4xx
with OpenAI's error shape, never a 5xx or a hang; afterwards the pool invariants hold, no block is
leaked, and a normal request still equals LLM.generate."""

from __future__ import annotations

import json
import random

import requests

from kvgen import SamplingParams
from tests.server.live import MODEL_NAME
from tests.support.models import PROMPTS

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
USER = [{"role": "user", "content": "Hi"}]
BASE = {CHAT: {"model": MODEL_NAME, "messages": USER, "max_tokens": 2},
        COMPLETIONS: {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2},
        RESPONSES: {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2}}  # fmt: skip
WRONG_VALUES = ["x", -1, 10**30, 3.5, None, True, [], {}, [1, "a"], {"a": {"b": 1}}, "\u0000", float("1e308") * 10]
FIELDS = {
    CHAT: ["model", "messages", "temperature", "top_p", "n", "stop", "max_tokens", "seed", "logit_bias", "tools", "tool_choice",
           "response_format", "logprobs", "top_logprobs", "stream_options", "presence_penalty", "metadata", "speculative"],
    COMPLETIONS: ["model", "prompt", "temperature", "n", "stop", "max_tokens", "logprobs", "echo", "best_of", "logit_bias"],
    RESPONSES: ["model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "text", "previous_response_id"],
}  # fmt: skip
DEEP_SCHEMA: dict = {"type": "object"}
for _ in range(80):
    DEEP_SCHEMA = {"type": "object", "properties": {"a": DEEP_SCHEMA}}


def wrong_type_cases() -> list[tuple[str, object]]:
    """Each field set to values of the wrong type or out of range (a value that happens to be valid
    for a field is skipped: `None` for an optional field, say)."""
    valid = [("stop", None), ("seed", -1), ("seed", True), ("echo", True), ("logprobs", True), ("logprobs", None),
             ("stream_options", {}), ("metadata", {}), ("logit_bias", {}), ("tools", []), ("stop", []), ("stop", "x"),
             ("stop", "\u0000"), ("prompt", "x"), ("prompt", "\u0000"), ("input", "x"), ("input", "\u0000"), ("instructions", "x"),
             ("instructions", "\u0000"), ("instructions", None), ("presence_penalty", -1), ("speculative", {}), ("text", {})]  # fmt: skip
    cases = []
    for path, fields in FIELDS.items():
        for field in fields:
            for value in WRONG_VALUES:
                if value is None and field not in ("model", "messages", "prompt", "input") or (field, value) in valid:
                    continue
                cases.append((path, BASE[path] | {field: value}))
    return cases


def hostile_cases() -> list[tuple[str, object]]:
    many = [{"role": "user", "content": "x"}] * 2000
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    return [
        (CHAT, b'{"model": "smollm2", "messages": ['), (CHAT, b"\xff\xfe\x00garbage"), (CHAT, b""), (CHAT, b"null"),
        (CHAT, b"[]"), (CHAT, b'"text"'), (CHAT, b"1e999"), (COMPLETIONS, b'{"model": "smollm2", "prompt": "a\\ud800b"}'),
        (CHAT, b'{"model": "smollm2", "messages": [{"role": "user", "content": "\\udfff"}]}'), (CHAT, b"{" * 100_000), (CHAT, b"[" * 1_000_000),
        (COMPLETIONS, b'{"model": "smollm2", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
        (COMPLETIONS, json.dumps({"model": MODEL_NAME, "prompt": "x" * (9 * 1024 * 1024)}).encode()),  # past the body limit
        (COMPLETIONS, BASE[COMPLETIONS] | {"prompt": "word " * 1_500_000}),  # under the body limit, far past the context
        (COMPLETIONS, BASE[COMPLETIONS] | {"prompt": [1] * 100_000}), (COMPLETIONS, BASE[COMPLETIONS] | {"prompt": [-1, 2]}),
        (COMPLETIONS, BASE[COMPLETIONS] | {"prompt": [10**12]}), (COMPLETIONS, BASE[COMPLETIONS] | {"prompt": []}),
        (COMPLETIONS, BASE[COMPLETIONS] | {"prompt": ["a"] * 500}), (COMPLETIONS, BASE[COMPLETIONS] | {"prompt": [[]]}),
        (COMPLETIONS, BASE[COMPLETIONS] | {"n": 16, "prompt": ["a"] * 8}), (COMPLETIONS, BASE[COMPLETIONS] | {"best_of": 4}),
        (CHAT, BASE[CHAT] | {"messages": many}), (CHAT, BASE[CHAT] | {"stop": ["a"] * 100}), (CHAT, BASE[CHAT] | {"stop": "s" * 10_000}),
        (CHAT, BASE[CHAT] | {"stop": [""]}), (CHAT, BASE[CHAT] | {"n": 10**6}), (CHAT, BASE[CHAT] | {"max_tokens": 10**12}),
        (CHAT, BASE[CHAT] | {"logprobs": True, "top_logprobs": 100}), (CHAT, BASE[CHAT] | {"logit_bias": {str(i): 1 for i in range(1000)}}),
        (CHAT, BASE[CHAT] | {"logit_bias": {"5": 500}}), (CHAT, BASE[CHAT] | {"logit_bias": {"-5": 1}}),
        (CHAT, BASE[CHAT] | {"metadata": {str(i): "v" for i in range(100)}}), (CHAT, BASE[CHAT] | {"metadata": {"k": "v" * 10_000}}),
        (CHAT, BASE[CHAT] | {"tools": [tool] * 200}), (CHAT, BASE[CHAT] | {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}),
        (CHAT, BASE[CHAT] | {"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP_SCHEMA}}]}),
        (CHAT, BASE[CHAT] | {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}]}),
        (CHAT, BASE[CHAT] | {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}}}]}),
        (CHAT, BASE[CHAT] | {"tools": [{"type": "retrieval"}]}), (CHAT, BASE[CHAT] | {"tool_choice": {"type": "function", "function": {"name": "f"}}}),
        (CHAT, BASE[CHAT] | {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}),
        (CHAT, BASE[CHAT] | {"response_format": {"type": "json_schema"}}), (CHAT, BASE[CHAT] | {"response_format": {"type": "xml"}}),
        (CHAT, BASE[CHAT] | {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        (CHAT, BASE[CHAT] | {"messages": [{"role": "wizard", "content": "x"}]}), (CHAT, BASE[CHAT] | {"messages": [{"role": "tool", "content": "x"}]}),
        (CHAT, BASE[CHAT] | {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
        (CHAT, BASE[CHAT] | {"messages": [{"role": "assistant", "content": None}]}),
        (CHAT, BASE[CHAT] | {"messages": [{"role": "user", "content": "x", "extra": 1}]}),
        (CHAT, BASE[CHAT] | {"stream": True, "n": 0}), (CHAT, BASE[CHAT] | {"priority": 5}), (CHAT, BASE[CHAT] | {"cache_salt": ""}),
        (CHAT, BASE[CHAT] | {"speculative": {"method": "self", "draft_layers": 10_000}}),
        (RESPONSES, BASE[RESPONSES] | {"input": [{"type": "function_call", "name": "f"}]}),
        (RESPONSES, BASE[RESPONSES] | {"input": [{"type": "image", "url": "x"}]}), (RESPONSES, BASE[RESPONSES] | {"input": []}),
        (RESPONSES, BASE[RESPONSES] | {"previous_response_id": "resp_missing"}),
        (RESPONSES, BASE[RESPONSES] | {"text": {"format": {"type": "json_schema"}}}),
        (RESPONSES, BASE[RESPONSES] | {"tools": [{"type": "web_search"}]}),
        (RESPONSES, BASE[RESPONSES] | {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"}]}),
    ]  # fmt: skip


def unknown_field_cases(rng: random.Random) -> list[tuple[str, object]]:
    cases = []
    for path in BASE:
        for _ in range(6):
            name = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz_") for _ in range(rng.randint(3, 12))) + "_x"
            cases.append((path, BASE[path] | {name: rng.choice(WRONG_VALUES[:4])}))
    return cases


def send(server, path: str, body: object, method: str = "POST") -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.request(method, f"{server.base_url}{path}", data=data, headers={"Content-Type": "application/json"}, timeout=60)


def assert_openai_error(response: requests.Response, case: str) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300], case)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"], (error, case)


def test_hostile_requests_get_4xx_and_change_nothing(server, smollm2) -> None:
    rng = random.Random(0)
    cases = wrong_type_cases() + hostile_cases() + unknown_field_cases(rng)
    assert len(cases) >= 200
    failures = []
    for path, body in cases:
        try:
            assert_openai_error(send(server, path, body), f"{path} {str(body)[:200]}")
        except AssertionError as e:
            failures.append(str(e)[:400])
    assert not failures, "\n".join(failures)
    for method, path in [("GET", CHAT), ("PUT", COMPLETIONS), ("POST", "/v1/nothing"), ("DELETE", "/v1/models")]:
        assert_openai_error(send(server, path, BASE[CHAT], method), f"{method} {path}")
    server.assert_no_leaks()
    reply = send(server, COMPLETIONS, BASE[COMPLETIONS] | {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}).json()
    expected = smollm2.generate(smollm2.tokenizer.encode(PROMPTS[0]), SamplingParams(max_new_tokens=8)).text
    assert reply["choices"][0]["text"] == expected
    server.assert_no_leaks()

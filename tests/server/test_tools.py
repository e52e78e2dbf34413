"""Tool calling through the official openai client on a live server (SmolLM2): every tool_choice mode,
streamed and not, single and parallel calls; arguments always parse and validate against the tool's
schema (the grammar guarantees it; the model picks the values); a two-turn tool conversation."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.server.live import MODEL_NAME

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}  # fmt: skip
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 24}}, "required": ["timezone"],
        "additionalProperties": False}  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')} of a place", "parameters": schema}}
         for name, schema in SCHEMAS.items()]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]


def call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


# One earlier exchange shows the 135M model what a call looks like, so "auto" picks one.
SHOWN = [{"role": "user", "content": "What is the weather in Oslo?"},
         {"role": "assistant", "content": None, "tool_calls": [call("call_1", "get_weather", {"city": "Oslo", "unit": "celsius"})]},
         {"role": "user", "content": "What is the weather in Paris?"}]  # fmt: skip
SHOWN_PARALLEL = [{"role": "user", "content": "What is the weather in Oslo and in Lima?"},
                  {"role": "assistant", "content": None, "tool_calls": [call("call_1", "get_weather", {"city": "Oslo", "unit": "celsius"}),
                                                                        call("call_2", "get_weather", {"city": "Lima", "unit": "celsius"})]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "3 degrees, snow"},
                  {"role": "tool", "tool_call_id": "call_2", "content": "22 degrees, sunny"},
                  {"role": "assistant", "content": "Oslo: 3 degrees and snow. Lima: 22 degrees and sunny."},
                  {"role": "user", "content": "What is the weather in Paris and in Rome?"}]  # fmt: skip


def assert_valid(calls: list[tuple[str, str, str]]) -> None:
    """(id, name, arguments) triples: known names, distinct ids, arguments valid under the schema."""
    assert calls and len({c[0] for c in calls}) == len(calls)
    for call_id, name, arguments in calls:
        assert call_id.startswith("call_") and name in SCHEMAS
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def streamed_calls(chunks: list) -> tuple[list[tuple[str, str, str]], str | None, str]:
    """Assemble tool_calls deltas as a client does: by index; id and name come first."""
    calls: dict[int, list[str]] = {}
    finish, content = None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.index not in calls and delta.function.arguments == ""
                    calls[delta.index] = [delta.id, delta.function.name, ""]
                else:
                    assert delta.function.name is None
                calls[delta.index][2] += delta.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)], finish, content


@pytest.mark.parametrize("mode", ["auto", "required", "named"])
@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_validate_in_every_calling_mode(client, server, mode, stream) -> None:
    messages = SHOWN if mode == "auto" else ASK
    choice = {"type": "function", "function": {"name": "get_time"}} if mode == "named" else mode
    kwargs = dict(model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=60, temperature=0)
    reply = client.chat.completions.create(**kwargs)
    message = reply.choices[0].message
    calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    assert_valid(calls)
    if mode == "named":
        assert {name for _, name, _ in calls} == {"get_time"}
    if stream:
        got, finish, content = streamed_calls(list(client.chat.completions.create(stream=True, **kwargs)))
        assert finish == "tool_calls" and content == ""
        assert_valid(got)
        assert [c[1:] for c in got] == [c[1:] for c in calls]  # greedy: the same calls, streamed
    server.assert_no_leaks()


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_none_answers_in_text(client, server, stream) -> None:
    kwargs = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=12, temperature=0)
    if stream:
        _, finish, content = streamed_calls(list(client.chat.completions.create(stream=True, **kwargs)))
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.message.tool_calls is None
        finish, content = choice.finish_reason, choice.message.content
    assert finish in ("stop", "length") and content and "<tool_call>" not in content


def test_parallel_calls_and_the_single_call_bound(client, server) -> None:
    kwargs = dict(model=MODEL_NAME, messages=SHOWN_PARALLEL, tools=TOOLS, tool_choice="required", max_tokens=100, temperature=0)
    parallel = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert len(parallel) >= 2
    assert_valid([(c.id, c.function.name, c.function.arguments) for c in parallel])
    got, finish, _ = streamed_calls(list(client.chat.completions.create(stream=True, **kwargs)))
    assert finish == "tool_calls" and [c[1:] for c in got] == [(c.function.name, c.function.arguments) for c in parallel]
    single = client.chat.completions.create(parallel_tool_calls=False, **kwargs).choices[0].message.tool_calls
    assert len(single) == 1
    assert_valid([(c.id, c.function.name, c.function.arguments) for c in single])
    server.assert_no_leaks()


def test_two_turn_tool_conversation(client, server, smollm2) -> None:
    first = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=60, temperature=0)  # fmt: skip
    (tool_call,) = first.choices[0].message.tool_calls
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tool_call.id, "content": "18 degrees and sunny"}]  # fmt: skip
    second = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none", max_tokens=16, temperature=0)
    assert second.choices[0].message.content and second.choices[0].message.tool_calls is None
    # the call and its result are in the prompt (with "none" the tool list is not shown)
    alone = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=1, temperature=0).usage.prompt_tokens
    assert second.usage.prompt_tokens > alone + len(smollm2.tokenizer.encode(tool_call.function.arguments + "18 degrees and sunny"))
    streamed = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none", max_tokens=16,
                                              temperature=0, stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == second.choices[0].message.content
    server.assert_no_leaks()


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=TOOLS + TOOLS[:1]), "tools"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]), "tools"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}]), "tools"),
        (dict(tools=TOOLS, response_format={"type": "json_object"}), "response_format"),
        (dict(messages=ASK + [{"role": "assistant", "tool_calls": [call("c", "get_time", {})], "content": None},
                              {"role": "tool", "content": "x"}]), "messages.2"),
        (dict(messages=ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                    "function": {"name": "f", "arguments": "{not json"}}]}]), "messages"),
    ],
    ids=["unknown-named-tool", "required-without-tools", "duplicate-names", "non-object-parameters", "unenforceable-schema",
         "tools-and-response-format", "tool-message-without-call-id", "history-arguments-not-json"],
)  # fmt: skip
def test_bad_tool_requests_are_400s_naming_the_field(client, server, kwargs, param) -> None:
    import openai

    arguments = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 4} | kwargs
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**arguments)
    assert caught.value.body["param"].startswith(param), caught.value.body
    server.assert_no_leaks()

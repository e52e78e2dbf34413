"""The Responses API through the official openai client (SmolLM2): text equals the same conversation
through chat completions, the event stream adds up to it, instructions, tools, and a tool turn
continued with previous_response_id (stored in memory, per API key)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.live import MODEL_NAME
from tests.server.test_tools import SCHEMAS, TOOLS

RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_text_equals_chat_and_the_stream_adds_up(client, server) -> None:
    reply = client.responses.create(model=MODEL_NAME, input="Name a primary color.", instructions="You are terse.",
                                    max_output_tokens=12, temperature=0)  # fmt: skip
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a primary color."}])  # fmt: skip
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens and reply.usage.output_tokens == chat.usage.completion_tokens
    assert reply.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    events = list(client.responses.create(model=MODEL_NAME, input="Name a primary color.", instructions="You are terse.",
                                          max_output_tokens=12, temperature=0, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if reply.status == "incomplete" else "response.completed"]  # fmt: skip
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reply.output_text
    assert events[-1].response.output_text == reply.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    server.assert_no_leaks()


def test_output_text_logprobs_equal_chat_and_the_stream_adds_up(client, server) -> None:
    ask = dict(model=MODEL_NAME, input="Name a primary color.", max_output_tokens=10, temperature=0,
               include=["message.output_text.logprobs"], top_logprobs=2)  # fmt: skip
    reply = client.responses.create(**ask)
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2,
                                          messages=[{"role": "user", "content": "Name a primary color."}])  # fmt: skip
    (part,) = reply.output[0].content
    assert len(part.logprobs) == reply.usage.output_tokens == len(chat.choices[0].logprobs.content)
    assert "".join(lp.token for lp in part.logprobs) == part.text == reply.output_text
    # The same tokens and values as chat's, to the last bits a prompt read partly from the prefix cache moves.
    for ours, theirs in zip(part.logprobs, chat.choices[0].logprobs.content):
        assert (ours.token, ours.bytes, ours.logprob) == (theirs.token, theirs.bytes, pytest.approx(theirs.logprob, abs=1e-4))
        assert [t.token for t in ours.top_logprobs] == [t.token for t in theirs.top_logprobs]
        assert [t.logprob for t in ours.top_logprobs] == pytest.approx([t.logprob for t in theirs.top_logprobs], abs=1e-4)
        assert len(ours.top_logprobs) == 2 and ours.top_logprobs[0].logprob == ours.logprob  # greedy: the best token
    events = list(client.responses.create(stream=True, **ask))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in part.logprobs], abs=1e-4)
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response.output[0].content[0].logprobs
    assert [(lp.token, lp.logprob, lp.bytes) for lp in done.logprobs] == [(lp.token, lp.logprob, lp.bytes) for lp in final]
    assert [(lp.token, lp.logprob) for lp in final] == [(lp.token, lp.logprob) for lp in streamed]
    without = client.responses.create(**(ask | {"include": None, "top_logprobs": None}))
    assert without.output_text == reply.output_text and without.output[0].content[0].logprobs == []
    server.assert_no_leaks()


def test_logprobs_kvgen_cannot_give_are_400s(client, server) -> None:
    with pytest.raises(openai.BadRequestError) as caught:  # alternatives without the logprobs themselves
        client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2, top_logprobs=2)
    assert caught.value.body["param"] == "top_logprobs" and "message.output_text.logprobs" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:  # a reply that may be function calls, not output text
        client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2, tools=RESPONSE_TOOLS,
                                include=["message.output_text.logprobs"])  # fmt: skip
    assert caught.value.body["param"] == "include" and "tools are active" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2, include=["file_search_call.results"])
    assert caught.value.body["param"] == "include"
    server.assert_no_leaks()


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_and_a_continued_turn(client, server, stream) -> None:
    kwargs = dict(model=MODEL_NAME, input="What is the weather in Paris?", tools=RESPONSE_TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=60, temperature=0)  # fmt: skip
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        reply = events[-1].response
        assert events[-1].type == "response.completed" and deltas == reply.output[0].arguments
    else:
        reply = client.responses.create(**kwargs)
    (item,) = reply.output
    assert item.type == "function_call" and item.status == "completed"
    jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])
    follow = client.responses.create(model=MODEL_NAME, previous_response_id=reply.id, max_output_tokens=10, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": item.call_id, "output": "18 degrees"}])  # fmt: skip
    assert follow.output[0].type == "message" and follow.output_text
    # the stored turn (question, call, result) is in the prompt; tools are not carried over, as OpenAI's
    question = client.responses.create(model=MODEL_NAME, input="What is the weather in Paris?", max_output_tokens=1)
    assert follow.usage.input_tokens > question.usage.input_tokens + len(item.arguments) // 4
    assert client.responses.retrieve(follow.id).output_text == follow.output_text
    server.assert_no_leaks()


def test_previous_response_errors(client, server) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL_NAME, input="hi", previous_response_id="resp_nope", max_output_tokens=2)
    assert caught.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL_NAME, input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_json_schema_text_format_validates(client, server) -> None:
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 12}}, "required": ["color"],
              "additionalProperties": False}  # fmt: skip
    reply = client.responses.create(model=MODEL_NAME, input="A color, as JSON.", max_output_tokens=30, temperature=0,
                                    text={"format": {"type": "json_schema", "name": "c", "schema": schema}})  # fmt: skip
    jsonschema.validate(json.loads(reply.output_text), schema)

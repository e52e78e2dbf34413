"""Gemma 3 (whose chat template insists on alternating user/model turns) behind the server: a
conversation the template rejects is an OpenAI-shaped 400, not a 500; tool calls and a tool turn work
through the fallback format (tool results become a user turn, so roles still alternate)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.live import MODEL_NAME, live_server
from tests.server.test_tools import SCHEMAS, TOOLS

pytestmark = pytest.mark.slow  # loads Gemma 3 and generates under grammars: about a minute


@pytest.fixture(scope="module")
def gemma_client(gemma3):
    with live_server(gemma3, max_tokens_limit=128) as live:
        yield openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0, timeout=300), live


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hello?"}],
    [{"role": "assistant", "content": "Hi"}],
])  # fmt: skip
def test_template_rejection_is_a_400(gemma_client, messages) -> None:
    client, live = gemma_client
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    body = caught.value.body
    assert body["param"] == "messages" and "alternate" in body["message"] and body["code"] == "invalid_messages"
    live.assert_no_leaks()


def test_tool_call_and_tool_turn(gemma_client) -> None:
    client, live = gemma_client
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL_NAME, messages=ask, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=60, temperature=0)  # fmt: skip
    (call,) = first.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    history = ask + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"},
                     {"role": "user", "content": "Thanks. Summarize."}]  # fmt: skip
    second = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    reply = client.responses.create(model=MODEL_NAME, input=ask, tools=[{"type": "function", **t["function"]} for t in TOOLS],
                                    tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=40, temperature=0)  # fmt: skip
    (item,) = reply.output
    assert item.name == "get_time"
    jsonschema.validate(json.loads(item.arguments), SCHEMAS["get_time"])
    live.assert_no_leaks()

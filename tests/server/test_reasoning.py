"""Reasoning models through the OpenAI server: `reasoning_content` beside the content, harmony's
tool calls (gpt-oss), the answer's grammar after the reasoning, the reasoning effort and the chat
template's variables, on a random-weight gpt-oss that transformers builds (with harmony's special
tokens) and on the real SmolLM2 under a template that reasons in <think> blocks."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import openai
import pytest

from kvgen.llm import LLM
from kvgen.replies import parse_reply
from kvgen.replies.harmony import HarmonyParser
from tests.server.live import LiveServer, live_server
from tests.support.tiny_hf import HARMONY_TOKENS, harmony_tokenizer_folder, save_tiny_decoder

THINK_TEMPLATE = (Path(__file__).parents[1] / "replies" / "think_template.jinja").read_text()
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    folder = tmp_path_factory.mktemp("gpt-oss-harmony")
    save_tiny_decoder("gpt-oss", folder, harmony_tokenizer_folder(folder / "tokenizer"), vocab_size=49152 + len(HARMONY_TOKENS))
    with live_server(LLM.load(folder, progress=False), max_tokens_limit=256) as live:
        yield live


@pytest.fixture(scope="module")
def thinking(smollm2: LLM) -> LiveServer:
    llm = copy.copy(smollm2)  # the shared model, another tokenizer object: the session's fixture keeps its template
    llm.tokenizer = smollm2.tokenizer.with_chat_template(THINK_TEMPLATE)
    with live_server(llm, max_tokens_limit=256) as live:
        yield live


def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def end_bias(live: LiveServer, bias: float) -> dict[str, float]:
    """A bias on <|end|>: the random model then closes its analysis message after a few tokens."""
    return {str(live.engine.engine.tokenizer.backend.token_to_id("<|end|>")): bias}


def streamed_message(chunks) -> dict:
    message: dict = {"reasoning_content": "", "content": "", "arguments": {}, "names": {}}
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        message["reasoning_content"] += getattr(delta, "reasoning_content", None) or ""
        message["content"] += delta.content or ""
        for call in delta.tool_calls or []:
            if call.function.name:
                message["names"][call.index] = call.function.name
            message["arguments"][call.index] = message["arguments"].get(call.index, "") + (call.function.arguments or "")
    return message


def test_harmony_tool_calls_follow_the_reasoning(harmony: LiveServer) -> None:
    """tool_choice required: an analysis message (reasoning_content), then a call harmony's way,
    its arguments valid for the schema; the message is what the raw tokens parse to, streamed or not."""
    openai_client, reasoned_and_called = client(harmony), 0
    for bias in (1.0, 1.1, 1.2, 1.3, 1.4, 1.5):
        request = dict(model="smollm2", messages=ASK, tools=WEATHER, tool_choice="required", max_tokens=64, temperature=0,
                       logit_bias=end_bias(harmony, bias))  # fmt: skip
        response = openai_client.chat.completions.create(**request, logprobs=True)
        choice = response.choices[0]
        raw = "".join(t.token for t in choice.logprobs.content)  # the tokens, special ones written out
        assert raw.startswith("<|channel|>")
        expected = parse_reply(HarmonyParser(), raw)
        assert getattr(choice.message, "reasoning_content", None) == expected.reasoning
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == expected.calls
        thinking = response.usage.completion_tokens_details.reasoning_tokens
        if choice.finish_reason == "tool_calls":
            assert choice.message.content is None and len(expected.calls) == 1
            arguments = json.loads(expected.calls[0][1])
            assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 8
            assert (thinking > 0) == bool(expected.reasoning) and thinking < response.usage.completion_tokens
            reasoned_and_called += bool(expected.reasoning)
        else:  # cut off by max_tokens, in its analysis message (all reasoning) or its call
            assert choice.finish_reason == "length" and thinking == (64 if not expected.calls else thinking)
        stream = streamed_message(openai_client.chat.completions.create(**request, stream=True))
        assert stream["reasoning_content"] == (expected.reasoning or "") and stream["content"] == ""
        assert [(stream["names"][i], stream["arguments"][i]) for i in sorted(stream["names"])] == expected.calls
    assert reasoned_and_called, "no bias let the model reason, then call: the test does not cover the split"
    harmony.assert_no_leaks()


def test_harmony_answers_follow_the_response_format_in_the_final_channel(harmony: LiveServer) -> None:
    """The schema holds the final message, not the analysis before it."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}}, "required": ["answer"],
              "additionalProperties": False}
    answered = 0
    for bias in (1.0, 1.2, 1.4, 1.6, 2.0):
        response = client(harmony).chat.completions.create(
            model="smollm2", messages=ASK, max_tokens=64, temperature=0, logit_bias=end_bias(harmony, bias), logprobs=True,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})  # fmt: skip
        raw = "".join(t.token for t in response.choices[0].logprobs.content)
        expected = parse_reply(HarmonyParser(), raw)
        message = response.choices[0].message
        assert (message.content, getattr(message, "reasoning_content", None)) == (expected.content, expected.reasoning)
        if response.choices[0].finish_reason == "stop":
            assert "<|channel|>final<|message|>" in raw and len(json.loads(message.content)["answer"]) <= 12
            answered += bool(expected.reasoning)
    assert answered, "no bias let the model reason, then answer: the test does not cover the split"


def test_reasoning_effort_goes_to_templates_that_read_it(harmony: LiveServer, thinking: LiveServer) -> None:
    low = client(harmony).chat.completions.create(model="smollm2", messages=ASK, max_tokens=4, reasoning_effort="low")
    assert low.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="reasoning_effort is not supported") as refused:
        client(thinking).chat.completions.create(model="smollm2", messages=ASK, max_tokens=4, reasoning_effort="low")
    assert refused.value.body["param"] == "reasoning_effort"
    with pytest.raises(openai.BadRequestError, match="reasoning.effort is not supported"):
        client(thinking).responses.create(model="smollm2", input="Hi", max_output_tokens=4, reasoning={"effort": "low"})
    thinking.assert_no_leaks()


def test_output_text_logprobs_are_refused_where_replies_carry_reasoning(thinking: LiveServer) -> None:
    # A reasoning reply's tokens are not all the output text's: kvgen does not split them by item.
    with pytest.raises(openai.BadRequestError, match="replies are 'think', not plain text") as refused:
        client(thinking).responses.create(model="smollm2", input="Hi", max_output_tokens=4, include=["message.output_text.logprobs"])
    assert refused.value.body["param"] == "include"
    thinking.assert_no_leaks()


def test_think_blocks_opened_by_the_template_come_back_as_reasoning(thinking: LiveServer) -> None:
    """The template opens <think> in the generation prompt; SmolLM2 never closes it, so its whole
    reply is reasoning, cut by max_tokens; with enable_thinking false the template closes the block
    and the reply is content."""
    openai_client = client(thinking)
    response = openai_client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=24, temperature=0, logprobs=True)
    message = response.choices[0].message
    assert message.reasoning_content == "".join(t.token for t in response.choices[0].logprobs.content) != ""
    assert message.content == "" and response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens_details.reasoning_tokens == response.usage.completion_tokens == 24
    plain = openai_client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=24, temperature=0,
                                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert plain.choices[0].message.content and getattr(plain.choices[0].message, "reasoning_content", None) is None
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    with pytest.raises(openai.BadRequestError, match="does not take 'thinking_budget'") as refused:
        openai_client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4,
                                              extra_body={"chat_template_kwargs": {"thinking_budget": 8}})  # fmt: skip
    assert refused.value.body["param"] == "chat_template_kwargs"
    thinking.assert_no_leaks()


def test_responses_put_the_reasoning_in_its_own_item(harmony: LiveServer) -> None:
    """Without a bias the random model stays in its analysis message: the response is a reasoning
    item, cut at max_output_tokens, all of its tokens reasoning; streamed, the same item."""
    openai_client = client(harmony)
    request = dict(model="smollm2", input="What is the weather in Paris?", max_output_tokens=24, temperature=0,
                   tools=[{"type": "function", **WEATHER[0]["function"]}], tool_choice="required")  # fmt: skip
    response = openai_client.responses.create(**request)
    assert response.status == "incomplete" and [item.type for item in response.output] == ["reasoning"]
    reasoning = response.output[0].content[0].text
    assert reasoning and response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens == 24
    events = list(openai_client.responses.create(**request, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert [i.type for i in events[-1].response.output] == ["reasoning"]
    follow = openai_client.responses.create(model="smollm2", input="And in Rome?", max_output_tokens=4,
                                            previous_response_id=response.id)  # fmt: skip
    fresh = openai_client.responses.create(model="smollm2", input="And in Rome?", max_output_tokens=4)
    assert follow.usage.input_tokens > fresh.usage.input_tokens  # the stored turn goes before it
    harmony.assert_no_leaks()


def test_completions_keep_special_tokens_when_asked(server) -> None:
    """skip_special_tokens false (vLLM's extension): the text keeps special tokens, here SmolLM2's
    <|im_end|> forced by a bias past EOS; by default they are left out."""
    request = dict(model="smollm2", prompt="Hi", max_tokens=3, temperature=0, logit_bias={"2": 100})
    openai_client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    kept = openai_client.completions.create(**request, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert kept.choices[0].text == "<|im_end|>" * 3
    assert openai_client.completions.create(**request, extra_body={"ignore_eos": True}).choices[0].text == ""

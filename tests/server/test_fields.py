"""Every OpenAI request field is honoured or refused: refused and unknown fields are 400s naming the
field (through the official openai client), and the honoured ones that are new here do what they say
(logit_bias on chat, response_format on completions, echo with prompt logprobs, several prompts,
metadata, and vLLM's sampling and structured_outputs extensions, top_k and logit_bias on Responses
too)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from kvgen import SamplingParams
from kvgen.quality import score
from kvgen.sampling.grammar import StructuredOutput
from tests.server.live import MODEL_NAME
from tests.support.models import PROMPTS

USER = [{"role": "user", "content": "Hello"}]

REFUSED = [
    ("chat", "audio", {"voice": "alloy", "format": "wav"}), ("chat", "functions", [{"name": "f"}]),
    ("chat", "function_call", "auto"), ("chat", "prediction", {"type": "file", "content": "x"}),
    ("chat", "reasoning_effort", "low"), ("chat", "verbosity", "low"), ("chat", "web_search_options", {}),
    ("chat", "prompt_cache_key", "k"), ("chat", "store", True), ("chat", "modalities", ["audio"]),
    ("chat", "service_tier", "flex"), ("chat", "priority", 1), ("chat", "stream_options", {"include_usage": True}),
    ("completions", "suffix", "end"), ("completions", "best_of", 3), ("completions", "prompt_cache_key", "k"),
    ("responses", "conversation", "conv_1"), ("responses", "max_tool_calls", 3), ("responses", "prompt", {"id": "p"}),
    ("responses", "reasoning", {"effort": "low"}), ("responses", "top_logprobs", 2), ("responses", "include", ["x"]),
    ("responses", "background", True), ("responses", "truncation", "auto"), ("responses", "stream_options", {}),
    ("chat", "temperature_typo", 1), ("completions", "foo", 1), ("responses", "max_tokens", 5),
]  # fmt: skip


def call(client: openai.OpenAI, endpoint: str, extra: dict):
    if endpoint == "chat":
        return client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2, extra_body=extra)
    if endpoint == "completions":
        return client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=2, extra_body=extra)
    return client.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=2, extra_body=extra)


@pytest.mark.parametrize("endpoint, field, value", REFUSED, ids=[f"{e}-{f}" for e, f, _ in REFUSED])
def test_refused_and_unknown_fields_are_400s_naming_them(client, server, endpoint, field, value) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        call(client, endpoint, {field: value})
    param = caught.value.body["param"]
    assert (param == field or param.startswith(field + ".")) and field in caught.value.body["message"], caught.value.body


def test_top_logprobs_without_logprobs_is_refused(client) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2, top_logprobs=3)
    assert caught.value.body["param"] == "top_logprobs"


def test_logit_bias_on_chat_equals_the_engine_free_reference(client, server, smollm2) -> None:
    ids = smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(USER), add_special_tokens=False)
    plain = smollm2.generate(ids, SamplingParams(max_new_tokens=6))
    banned = {plain.token_ids[0]: -100.0}  # the greedy first token, banned
    expected = smollm2.generate(ids, SamplingParams(max_new_tokens=6, logit_bias=banned)).text
    reply = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=6, temperature=0,
                                           logit_bias={str(t): v for t, v in banned.items()})  # fmt: skip
    assert reply.choices[0].message.content == expected != plain.text
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2, logit_bias={"99999999": 1})
    assert caught.value.body["param"] == "logit_bias"


def test_top_k_and_logit_bias_on_responses_equal_chats(client, server, smollm2) -> None:
    """vLLM's Responses takes top_k and logit_bias as its chat does: the same text as chat for the same
    conversation and fields, top_k=1 at temperature 1.5 the greedy text, a bias off the vocabulary a 400."""
    greedy = client.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=8, temperature=0)
    narrowed = client.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=8, temperature=1.5, extra_body={"top_k": 1})
    assert narrowed.output_text == greedy.output_text
    bias = {str(smollm2.tokenizer.encode(greedy.output_text, add_special_tokens=False)[0]): -100.0}  # its first token, banned
    biased = client.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=8, temperature=0, extra_body={"logit_bias": bias})
    chat = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=8, temperature=0, logit_bias=bias)
    assert biased.output_text == chat.choices[0].message.content != greedy.output_text
    for field, value in (("logit_bias", {"99999999": 1}), ("top_k", -2)):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=2, extra_body={field: value})
        assert caught.value.body["param"] == field
    server.assert_no_leaks()


def test_response_format_on_completions(client, server) -> None:
    reply = client.completions.create(model=MODEL_NAME, prompt="A JSON object describing a cat:", max_tokens=40, temperature=0,
                                      extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "cat", "schema": {
                                          "type": "object", "properties": {"name": {"type": "string", "maxLength": 10}},
                                          "required": ["name"], "additionalProperties": False}}}})  # fmt: skip
    assert set(json.loads(reply.choices[0].text)) == {"name"}


def test_echo_with_prompt_logprobs(client, server, smollm2) -> None:
    ids = smollm2.tokenizer.encode(PROMPTS[0])
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True, logprobs=2)
    generated = smollm2.generate(ids, SamplingParams(max_new_tokens=3)).text
    choice = reply.choices[0]
    assert choice.text == PROMPTS[0] + generated
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # the prompt's logprobs equal a token-by-token decode of it (a different path than the chunked scoring)
    reference = score(smollm2.model, smollm2.generator.new_cache, ids, chunk_size=1).logprobs.tolist()
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(reference, abs=2e-3)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    streamed = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    server.assert_no_leaks()


def test_several_prompts_metadata_and_user(client, server, smollm2) -> None:
    reply = client.completions.create(model=MODEL_NAME, prompt=[PROMPTS[1], PROMPTS[2]], max_tokens=4, temperature=0, n=2,
                                      user="tester", extra_body={"metadata": {"team": "kv"}})  # fmt: skip
    expected = [smollm2.generate(smollm2.tokenizer.encode(p), SamplingParams(max_new_tokens=4)).text for p in PROMPTS[1:3]]
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == [expected[0]] * 2 + [expected[1]] * 2
    prompt_tokens = sum(len(smollm2.tokenizer.encode(p)) for p in PROMPTS[1:3])
    assert reply.usage.prompt_tokens == prompt_tokens and reply.usage.completion_tokens == 16
    assert reply.model_extra["metadata"] == {"team": "kv"}
    server.assert_no_leaks()


def test_vllm_sampling_extensions_equal_llm_generate(client, server, smollm2) -> None:
    """top_k, min_p, repetition_penalty, min_tokens, stop_token_ids and include_stop_str_in_output
    (vLLM's extra_body names) do what the same SamplingParams do in LLM.generate."""
    ids = smollm2.tokenizer.encode(PROMPTS[0])

    def ours(**extra) -> openai.types.Completion:
        return client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, extra_body=extra,
                                         temperature=extra.pop("temperature", 0))  # fmt: skip

    def reference(**fields) -> str:
        return smollm2.generate(ids, SamplingParams(max_new_tokens=12, **fields)).text

    greedy = reference()
    # top_k 1 and min_p 1 keep only the likeliest token: greedy even when sampling hot
    assert ours(top_k=1, temperature=1.5, seed=3).choices[0].text == greedy
    assert ours(min_p=1.0, temperature=1.5, seed=3).choices[0].text == greedy
    assert ours(top_k=-1).choices[0].text == greedy  # -1: off, as vLLM's
    assert ours(temperature=1.5, seed=3).choices[0].text != greedy  # what those two would be without them
    hot = dict(temperature=1.2, seed=7)
    assert ours(top_k=5, min_p=0.05, **hot).choices[0].text == reference(top_k=5, min_p=0.05, temperature=1.2, seed=7)
    penalised = reference(repetition_penalty=1.5)
    assert penalised != greedy
    assert ours(repetition_penalty=1.5).choices[0].text == penalised
    stop = greedy[4:7]
    kept = ours(stop=[stop], include_stop_str_in_output=True).choices[0]
    assert kept.text == greedy[: greedy.find(stop) + len(stop)] == reference(stop=(stop,), include_stop_str_in_output=True)
    stop_id = smollm2.generate(ids, SamplingParams(max_new_tokens=12)).token_ids[5]
    stopped = ours(stop_token_ids=[stop_id]).choices[0]
    assert stopped.text == reference(stop_token_ids=(stop_id,)) and stopped.finish_reason == "stop"
    chat = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    short = client.chat.completions.create(model=MODEL_NAME, messages=chat, max_tokens=40, temperature=0)
    assert short.usage.completion_tokens < 20  # it ends on its own first
    long = client.chat.completions.create(model=MODEL_NAME, messages=chat, max_tokens=40, temperature=0, extra_body={"min_tokens": 20})
    assert long.usage.completion_tokens >= 20
    for extra, param in [({"min_tokens": 13}, "min_tokens"), ({"stop_token_ids": [smollm2.tokenizer.vocab_size]}, "stop_token_ids"),
                         ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as caught:
            ours(**extra)
        assert caught.value.body["param"] == param, caught.value.body
    server.assert_no_leaks()


def test_structured_outputs_extension_constrains_the_reply(client, server, smollm2) -> None:
    """vLLM's structured_outputs: choice, regex, a Lark or GBNF grammar, JSON; the reply equals
    LLM.generate under the same constraint."""
    messages = [{"role": "user", "content": "Is the sky blue?"}]

    def chat(**constraint) -> openai.types.chat.chat_completion.Choice:
        return client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0,
                                              extra_body={"structured_outputs": constraint}).choices[0]  # fmt: skip

    picked = chat(choice=["yes", "no", "it depends"])
    assert picked.message.content in ("yes", "no", "it depends") and picked.finish_reason == "stop"
    pattern = r"(Yes|No), [a-z]{1,12}\."
    matched = chat(regex=pattern).message.content
    assert re.fullmatch(pattern, matched)
    ids = smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert matched == smollm2.generate(ids, SamplingParams(max_new_tokens=24, structured=StructuredOutput.regex(pattern))).text
    assert re.fullmatch(r"The answer is (yes|no)\.", chat(grammar='start: "The answer is " ("yes" | "no") "."').message.content)
    assert re.fullmatch(r"[0-9]{2}", chat(grammar="root ::= [0-9] [0-9]").message.content)  # GBNF
    schema = {"type": "object", "properties": {"blue": {"type": "boolean"}}, "required": ["blue"], "additionalProperties": False}
    jsonschema.validate(json.loads(chat(json=schema).message.content), schema)
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                           extra_body={"structured_outputs": {"choice": ["red", "green"]}})  # fmt: skip
    assert completion.choices[0].text in ("red", "green")
    refused = [({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
               ({"structured_outputs": {}}, "structured_outputs"),
               ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
               ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
               ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs.json"),
               ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs"),
               ({"structured_outputs": {"choice": ["a"]}, "tools": [{"type": "function", "function": {"name": "f"}}]},
                "structured_outputs")]  # fmt: skip
    for extra, param in refused:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, extra_body=extra)
        assert caught.value.body["param"] == param, (extra, caught.value.body)
    server.assert_no_leaks()


def test_continue_final_message_continues_the_assistant_reply(client, server, smollm2) -> None:
    asked = [{"role": "user", "content": "Name a primary color."}]
    begun = asked + [{"role": "assistant", "content": "One primary color is"}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=begun, max_tokens=8, temperature=0,
                                           extra_body={"continue_final_message": True, "add_generation_prompt": False})  # fmt: skip
    prompt = smollm2.tokenizer.apply_chat_template(asked) + "One primary color is"
    ids = smollm2.tokenizer.encode(prompt, add_special_tokens=False)
    assert reply.choices[0].message.content == smollm2.generate(ids, SamplingParams(max_new_tokens=8)).text
    assert reply.usage.prompt_tokens == len(ids)
    bare = client.chat.completions.create(model=MODEL_NAME, messages=asked, max_tokens=1, extra_body={"add_generation_prompt": False})
    assert bare.usage.prompt_tokens == len(smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(asked, add_generation_prompt=False),
                                                                    add_special_tokens=False))  # fmt: skip
    for messages, extra in [(begun, {"continue_final_message": True}), (asked, {"continue_final_message": True, "add_generation_prompt": False})]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2, extra_body=extra)
        assert caught.value.body["param"] == "continue_final_message", caught.value.body
    server.assert_no_leaks()

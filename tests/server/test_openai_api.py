"""The server through the official openai client on a live localhost uvicorn (SmolLM2): outputs
equal the engine-free reference (LLM.generate), streaming adds up, usage adds up, and /metrics."""

from __future__ import annotations

import openai
import requests
import pytest

from kvgen import SamplingParams
from tests.server.live import MODEL_NAME
from tests.support.models import PROMPTS


def reference(llm, prompt_ids: list[int], max_tokens: int) -> str:
    return llm.generate(prompt_ids, SamplingParams(max_new_tokens=max_tokens)).text


def chat_ids(llm, messages: list[dict]) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)


def test_models_and_health(client, server) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no-such-model")
    assert requests.get(f"{server.base_url}/health", timeout=30).json()["status"] == "ok"


def test_completion_equals_the_reference_and_usage_adds_up(client, server, smollm2) -> None:
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    ids = smollm2.tokenizer.encode(PROMPTS[0])
    assert reply.choices[0].text == reference(smollm2, ids, 10)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 10
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    server.assert_no_leaks()


def test_chat_and_its_stream_agree(client, server, smollm2) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a primary color."}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0)
    expected = reference(smollm2, chat_ids(smollm2, messages), 12)
    assert reply.choices[0].message.content == expected and reply.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [reply.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == len(chat_ids(smollm2, messages))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the second run hit the prefix cache
    server.assert_no_leaks()


def test_n_choices_with_a_seed_and_their_usage(client, server) -> None:
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0.9, seed=11, n=3)
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0.9, seed=11, n=3)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert [c.text for c in reply.choices] == [c.text for c in again.choices]  # seeded: repeatable
    assert reply.usage.completion_tokens == 18 and reply.usage.total_tokens == reply.usage.prompt_tokens + 18
    server.assert_no_leaks()


def test_streamed_completion_with_n(client, server, smollm2) -> None:
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=8, temperature=0, n=2, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    expected = reference(smollm2, smollm2.tokenizer.encode(PROMPTS[3]), 8)
    assert texts == {0: expected, 1: expected}
    server.assert_no_leaks()


def test_a_disconnect_mid_stream_frees_the_request(server) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True}
    with requests.post(f"{server.base_url}/v1/completions", json=body, stream=True, timeout=60) as response:
        lines = response.iter_lines(decode_unicode=True)
        received = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
        assert received
    server.wait_idle(timeout=5)  # 200 tokens would take far longer: the disconnect cancelled it
    server.assert_no_leaks()
    text = requests.get(f"{server.base_url}/metrics", timeout=30).text
    assert 'kvgen_requests_total{endpoint="completions",status="cancelled"} 1.0' in text


def test_api_key_is_required_when_set(smollm2) -> None:
    from tests.server.live import live_server

    with live_server(smollm2, api_key="s3cret") as live:
        anonymous = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            anonymous.models.list()
        keyed = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="s3cret", max_retries=0)
        assert keyed.models.list().data[0].id == MODEL_NAME
        for path in ("/tokenize", "/detokenize"):  # the token routes too
            body = {"prompt": "hi"} if path == "/tokenize" else {"tokens": [1]}
            assert requests.post(f"{live.base_url}{path}", json=body, timeout=30).status_code == 401
            keyed_post = requests.post(f"{live.base_url}{path}", json=body, headers={"Authorization": "Bearer s3cret"}, timeout=30)
            assert keyed_post.status_code == 200


def test_metrics_count_requests_tokens_and_latencies(client, server) -> None:
    client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=5, temperature=0)
    text = requests.get(f"{server.base_url}/metrics", timeout=30).text
    for name in ("kvgen_requests_total", "kvgen_generation_tokens_total", "kvgen_time_to_first_token_seconds_bucket",
                 "kvgen_inter_token_latency_seconds_bucket", "kvgen_kv_blocks_in_use", "kvgen_prefix_cache_hit_rate"):  # fmt: skip
        assert name in text, name
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and not line.startswith("#")}
    assert values['kvgen_requests_total{endpoint="completions",status="ok"}'] >= 1
    assert values["kvgen_generation_tokens_total"] >= 5
    assert values["kvgen_time_to_first_token_seconds_count"] >= 1


def test_json_schema_output_validates(client, server) -> None:
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Invent a person; answer in JSON."}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )  # fmt: skip
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    assert reply.choices[0].finish_reason == "stop"
    obj = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "A JSON list of colors."}],
                                         max_tokens=40, temperature=0, response_format={"type": "json_object"})  # fmt: skip
    assert obj.choices[0].finish_reason == "length" or isinstance(json.loads(obj.choices[0].message.content), dict)
    server.assert_no_leaks()


def test_stop_strings_and_logprobs_match_the_reference(client, server, smollm2) -> None:
    ids = smollm2.tokenizer.encode(PROMPTS[0])
    full = smollm2.generate(ids, SamplingParams(max_new_tokens=12)).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = smollm2.generate(ids, SamplingParams(max_new_tokens=12, stop=(stop,)))
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop], logprobs=2)
    assert reply.choices[0].text == expected.text and stop not in reply.choices[0].text
    assert reply.choices[0].finish_reason == "stop"
    reference = smollm2.generate(ids, SamplingParams(max_new_tokens=4, logprobs=True, top_logprobs=2)).logprobs
    chat_free = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2)
    got = chat_free.choices[0].logprobs
    assert got.token_logprobs == pytest.approx([lp.logprob for lp in reference], abs=1e-4)
    assert [len(top) for top in got.top_logprobs] == [2] * 4
    streamed = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                              temperature=0, logprobs=True, top_logprobs=1, stream=True)  # fmt: skip
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 3 and all(len(e.top_logprobs) == 1 and e.logprob <= 0 for e in entries)
    server.assert_no_leaks()


def test_speculative_extension_gives_the_plain_output_and_counts_acceptance(client, server, smollm2) -> None:
    """Per-request opt-in (`speculative` in the body, sent with the openai client's extra_body):
    the text is the plain greedy one, streamed or not, and /metrics reports drafts and acceptance."""
    prompt = "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"
    expected = reference(smollm2, smollm2.tokenizer.encode(prompt), 16)
    for options in ({"method": "lookup"}, {"method": "self", "draft_layers": 24, "num_draft_tokens": 3}, {"method": "eagle"}):
        reply = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0,
                                          extra_body={"speculative": options})  # fmt: skip
        assert reply.choices[0].text == expected and reply.usage.completion_tokens == 16, options
        chunks = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                           extra_body={"speculative": options})  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected, options
    text = requests.get(f"{server.base_url}/metrics", timeout=30).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and not line.startswith("#")}
    assert values["kvgen_spec_draft_tokens"] > 0 and values["kvgen_spec_accepted_tokens"] > 0
    assert 0 < values["kvgen_spec_acceptance_rate"] <= 1
    server.assert_no_leaks()


def test_chat_prediction_gives_the_plain_reply_and_counts_its_drafts_in_usage(client, server, smollm2) -> None:
    """Predicted Outputs: the reply is the one without a prediction; usage's completion details count
    the drafted tokens kept and rejected, streamed (include_usage) or not."""
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    expected = reference(smollm2, chat_ids(smollm2, messages), 24)
    for prediction in (expected, {"type": "content", "content": [{"type": "text", "text": expected}]}):
        content = prediction if isinstance(prediction, str) else prediction["content"]
        reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0,
                                               prediction={"type": "content", "content": content})  # fmt: skip
        assert reply.choices[0].message.content == expected
        details = reply.usage.completion_tokens_details
        assert details.accepted_prediction_tokens >= 12 and details.rejected_prediction_tokens >= 0
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 prediction={"type": "content", "content": expected}))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens >= 12
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0)
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens is None  # no prediction, no count
    with pytest.raises(openai.BadRequestError) as caught:  # prediction drafts by lookup: another method is refused
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, prediction={"type": "content", "content": "x"},
                                       extra_body={"speculative": {"method": "eagle"}})  # fmt: skip
    assert caught.value.body["param"] == "prediction" and "lookup" in caught.value.body["message"]
    server.assert_no_leaks()

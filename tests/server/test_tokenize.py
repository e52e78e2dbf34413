"""/tokenize and /detokenize on a live server (SmolLM2): the counts are the prompt tokens a request
is billed for, the ids are the tokenizer's, and bad input is a 400 naming the field."""

from __future__ import annotations

import requests

from tests.server.live import MODEL_NAME

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a primary color."}]


def post(server, path: str, body: dict) -> requests.Response:
    return requests.post(f"{server.base_url}{path}", json=body, timeout=60)


def test_counts_equal_what_requests_are_billed(client, server, smollm2) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    said = post(server, "/tokenize", {"model": MODEL_NAME, "prompt": text, "return_token_strs": True}).json()
    assert said["tokens"] == smollm2.tokenizer.encode(text) and said["count"] == len(said["tokens"])
    assert said["token_strs"] == [smollm2.tokenizer.id_to_token(i) for i in said["tokens"]]
    assert said["max_model_len"] == server.engine.engine.max_context
    completion = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=1)
    assert completion.usage.prompt_tokens == said["count"]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1)
    conversation = post(server, "/tokenize", {"messages": MESSAGES}).json()
    assert conversation["count"] == chat.usage.prompt_tokens and conversation["token_strs"] is None
    bare = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["tokens"] == conversation["tokens"][: bare["count"]] and bare["count"] < conversation["count"]
    unspecial = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert unspecial["tokens"] == smollm2.tokenizer.encode(text, add_special_tokens=False)
    assert post(server, "/detokenize", {"tokens": conversation["tokens"]}).json()["prompt"] == smollm2.tokenizer.decode(
        conversation["tokens"], skip_special_tokens=False)  # fmt: skip
    server.assert_no_leaks()


def test_bad_input_is_a_400_naming_the_field(server, smollm2) -> None:
    vocab = smollm2.tokenizer.vocab_size
    cases = [
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"), ("/tokenize", {}, "prompt"),
        ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": False}, "add_generation_prompt"),
        ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"no_such_variable": 1}}, "chat_template_kwargs"),
        ("/tokenize", {"prompt": "a", "temperature": 0}, "temperature"),
        ("/detokenize", {"tokens": [1, vocab]}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ]  # fmt: skip
    for path, body, param in cases:
        answer = post(server, path, body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, (path, body, answer.text)
    unknown = post(server, "/tokenize", {"model": "no-such-model", "prompt": "a"})
    assert unknown.status_code == 404 and "no-such-model" in unknown.json()["error"]["message"]
    server.assert_no_leaks()

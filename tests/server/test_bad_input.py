"""Bad requests get OpenAI-style 4xx errors with an error body, and leave the engine exactly as it
was: invariants hold and no block is held by anything but the prefix index."""

from __future__ import annotations

import openai
import pytest
import requests

from tests.server.live import MODEL_NAME
from tests.support.models import PROMPTS

USER = [{"role": "user", "content": "Hello"}]


def post_raw(server, path: str, data: str) -> requests.Response:
    return requests.post(f"{server.base_url}{path}", data=data, headers={"Content-Type": "application/json"}, timeout=60)


def test_malformed_json(server) -> None:
    response = post_raw(server, "/v1/chat/completions", '{"model": "smollm2", "messages": [')
    assert response.status_code == 400
    error = response.json()["error"]
    assert "not valid JSON" in error["message"] and error["type"] == "invalid_request_error"
    server.assert_no_leaks()


@pytest.mark.parametrize(
    "call, status, fragment",
    [
        (lambda c: c.chat.completions.create(model=MODEL_NAME, messages=USER, temperature="hot"), 400, "temperature"),
        (lambda c: c.chat.completions.create(model=MODEL_NAME, messages=[]), 400, "messages"),
        (lambda c: c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user"}]), 400, "content"),
        (lambda c: c.chat.completions.create(model="gpt-9", messages=USER), 404, "does not exist"),
        (lambda c: c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=100_000), 400, "at most 256"),
        (lambda c: c.completions.create(model=MODEL_NAME, prompt=[1] * 9000, max_tokens=4), 400, "limit is"),
        (lambda c: c.completions.create(model=MODEL_NAME, prompt=""), 400, "prompt"),
        (lambda c: c.completions.create(model=MODEL_NAME, prompt=[10**9], max_tokens=4), 400, "outside the vocabulary"),
        (lambda c: c.chat.completions.create(model=MODEL_NAME, messages=USER, n=0), 400, "n"),
        (lambda c: c.chat.completions.create(model=MODEL_NAME, messages=USER, top_p=0), 400, "top_p"),
        (lambda c: c.chat.completions.create(
            model=MODEL_NAME, messages=USER,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}),
         400, "response_format"),
        (lambda c: c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4,
                                        extra_body={"speculative": {"method": "telepathy"}}), 400, "speculative"),
        (lambda c: c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4,
                                        extra_body={"speculative": {"method": "self", "draft_layers": 99}}), 400, "draft_layers"),
        (lambda c: c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4,
                                        extra_body={"speculative": {"method": "eagle", "draft_layers": 8}}), 400,
         "draft_layers is only used by method 'self'"),
    ],
    ids=["wrong-type", "empty-messages", "message-without-content", "unknown-model", "max-tokens-past-limit",
         "prompt-past-context", "empty-prompt", "token-outside-vocab", "n-zero", "top-p-zero", "invalid-schema",
         "unknown-speculative-method", "draft-layers-past-the-model", "draft-layers-for-another-method"],
)  # fmt: skip
def test_bad_requests_get_4xx_and_change_nothing(client, server, call, status, fragment) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        call(client)
    assert caught.value.status_code == status
    body = caught.value.body
    assert isinstance(body, dict) and (fragment in body["message"] or fragment == body["param"]), body
    server.assert_no_leaks()
    # and the server still serves
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_too_many_concurrent_requests_get_429_and_free_their_drafters(smollm2) -> None:
    """Each choice is built once (validation), and a request the server cannot take frees what its
    built choices hold: here a self-draft proposer per choice."""
    from tests.server.live import live_server

    with live_server(smollm2, max_concurrent=0) as live:
        built, released = [], []
        make_request = live.engine.engine.make_request

        def recording(*args, **kwargs):
            request = make_request(*args, **kwargs)
            release = request.release_speculation
            request.release_speculation = lambda: (released.append(request.request_id), release())[1]
            built.append(request.request_id)
            return request

        live.engine.engine.make_request = recording
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=2, n=2,
                                      extra_body={"speculative": {"method": "self", "draft_layers": 4}})  # fmt: skip
        assert len(built) == 2 and built[0].endswith("-0") and built[1].endswith("-1"), built
        assert sorted(released) == sorted(built)
        live.assert_no_leaks()

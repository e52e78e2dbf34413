"""Several API keys on one server: each key is a tenant with its own prefix-cache namespace, so two
keys sending the same system prompt never share blocks (cached_tokens 0 across keys, > 0 within one),
and `cache_salt` splits one key's requests further. Also: `priority` when the server allows it, and
server limits checked when the server is built."""

from __future__ import annotations

import openai
import pytest

from kvgen.server import ServerConfig, ServerLimits
from tests.server.live import MODEL_NAME, live_server

SYSTEM = ("You are the assistant of a small bakery. You answer questions about bread, opening hours and prices, "
          "politely and in one sentence, and you never invent prices you were not told.")  # fmt: skip


@pytest.fixture(scope="module")
def tenants(smollm2):
    with live_server(smollm2, api_keys=("key-a", "key-b"), allow_priority=True, max_tokens_limit=64) as live:
        yield live


def ask(live, key: str, question: str, **extra) -> int:
    client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=key, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=MODEL_NAME, max_tokens=2, temperature=0, extra_body=extra or None,
                                           messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])  # fmt: skip
    assert reply.usage.prompt_tokens > 48  # the shared system prompt spans several 16-token blocks
    return reply.usage.prompt_tokens_details.cached_tokens


def test_keys_never_share_prefix_blocks(tenants) -> None:
    assert ask(tenants, "key-a", "When do you open?") == 0
    assert ask(tenants, "key-a", "Do you sell rye bread?") > 0  # same key, same system prompt: a hit
    assert ask(tenants, "key-b", "When do you open?") == 0  # the other key: its own namespace
    assert ask(tenants, "key-b", "Do you sell rye bread?") > 0
    assert ask(tenants, "key-a", "When do you open?", cache_salt="user-7") == 0  # a salt splits a key further
    assert ask(tenants, "key-a", "Do you sell rye bread?", cache_salt="user-7") > 0
    tenants.assert_no_leaks()


def test_unknown_key_and_stored_responses_are_per_key(tenants) -> None:
    with pytest.raises(openai.AuthenticationError):
        ask(tenants, "key-c", "Hello?")
    a = openai.OpenAI(base_url=f"{tenants.base_url}/v1", api_key="key-a", max_retries=0)
    b = openai.OpenAI(base_url=f"{tenants.base_url}/v1", api_key="key-b", max_retries=0)
    stored = a.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2)
    assert a.responses.retrieve(stored.id).id == stored.id
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(stored.id)
    with pytest.raises(openai.BadRequestError):
        b.responses.create(model=MODEL_NAME, input="Hi", previous_response_id=stored.id, max_output_tokens=2)


def test_priority_when_the_server_allows_it(tenants) -> None:
    assert ask(tenants, "key-a", "Is there parking?", priority=-1) >= 0


@pytest.mark.parametrize(
    "build, fragment",
    [
        (lambda: ServerLimits(max_stop=0), "max_stop"),
        (lambda: ServerLimits(max_body_bytes=10), "max_body_bytes"),
        (lambda: ServerLimits(max_top_logprobs=50), "max_top_logprobs"),
        (lambda: ServerConfig(MODEL_NAME, max_tokens_limit=0), "max_tokens_limit"),
        (lambda: ServerConfig(MODEL_NAME, api_keys=("has space",)), "API key"),
        (lambda: ServerConfig(MODEL_NAME, max_prompt_tokens=-5), "max_prompt_tokens"),
    ],
)
def test_limits_are_checked_at_start(build, fragment) -> None:
    with pytest.raises(ValueError, match=fragment):
        build()


def test_serve_options_collect_keys_and_fail_before_loading(tmp_path) -> None:
    from kvgen.cli import build_parser
    from kvgen.server.launch import server_config

    keys_file = tmp_path / "keys"
    keys_file.write_text("# team keys\nkey-c\n\nkey-d\n")
    args = build_parser().parse_args(["serve", "smollm2", "--api-key", "key-a", "--api-key", "key-b", "--api-keys-file", str(keys_file)])
    config = server_config(args, env_key="ignored")
    assert config.keys == ("key-a", "key-b", "key-c", "key-d") and not config.allow_priority
    assert server_config(build_parser().parse_args(["serve", "smollm2"]), env_key="env").keys == ("env",)
    with pytest.raises(ValueError, match="API keys file"):
        server_config(build_parser().parse_args(["serve", "smollm2", "--api-keys-file", str(tmp_path / "missing")]), None)

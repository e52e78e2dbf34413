"""The router's block keys are the engine's: what the ingress computes from a raw request body is
found in the prefix index of the server that ran that very request (chat template, tenant salt and
the always-computed last token included)."""

from __future__ import annotations

import json

import requests

from kvgen.engine.config import EngineConfig
from kvgen.replicas.prompt_key import index_keys, prompt_keys, request_keys
from kvgen.server.config import ServerConfig
from tests.server.live import MODEL_NAME, live_server

SYSTEM = "You are a careful assistant for a shipping company. " * 12


def test_keys_of_a_served_request_are_in_the_servers_prefix_index(smollm2) -> None:
    config = ServerConfig(MODEL_NAME, api_keys=("k1",))
    bodies = {
        "/v1/chat/completions": {"model": MODEL_NAME, "max_tokens": 2, "cache_salt": "team",
                                 "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is my parcel?"}]},
        "/v1/completions": {"model": MODEL_NAME, "max_tokens": 2, "prompt": SYSTEM + "Question: when do you open?"},
    }  # fmt: skip
    with live_server(smollm2, EngineConfig(num_blocks=256), api_keys=("k1",)) as server:
        for path, body in bodies.items():
            raw = json.dumps(body).encode()
            reply = requests.post(server.base_url + path, data=raw, headers={"Authorization": "Bearer k1"}, timeout=60)
            assert reply.status_code == 200, reply.text
            keys = request_keys(smollm2.tokenizer, 16, config, path, raw, "Bearer k1")
            held = set(server.engine.run_locked(lambda e: index_keys(e.scheduler.prefix)))
            assert len(keys) >= 5 and set(keys) <= held, path
            # Another tenant's or salt's request shares no key with it (the engine's namespaces).
            assert not set(request_keys(smollm2.tokenizer, 16, config, path, raw, "Bearer other")) & held
        server.assert_no_leaks()


def test_requests_without_a_prompt_have_no_keys(smollm2) -> None:
    config = ServerConfig(MODEL_NAME)
    tokenizer = smollm2.tokenizer
    assert request_keys(tokenizer, 16, config, "/v1/chat/completions", b"not json", None) == ()
    assert request_keys(tokenizer, 16, config, "/v1/chat/completions", b'{"messages": 3}', None) == ()
    assert request_keys(tokenizer, 16, config, "/v1/models", b"{}", None) == ()
    ids = list(range(100, 133))  # 33 tokens: the last one is always computed, so 2 full blocks
    assert len(prompt_keys(ids, 16, "")) == 2 and len(prompt_keys(ids[:32], 16, "")) == 1
    raw = json.dumps({"model": MODEL_NAME, "prompt": ids}).encode()
    assert request_keys(tokenizer, 16, config, "/v1/completions", raw, None) == prompt_keys(ids, 16, "")

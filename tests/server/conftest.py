from __future__ import annotations

import openai
import pytest

from tests.server.live import LiveServer, live_server


@pytest.fixture(scope="module")
def server(smollm2) -> LiveServer:
    with live_server(smollm2, max_tokens_limit=256) as live:
        yield live


@pytest.fixture()
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)

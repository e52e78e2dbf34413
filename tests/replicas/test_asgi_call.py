"""A replica serves a forwarded request by calling the kvgen app in process: the response is the
app's own (status, headers, SSE events), and leaving a stream early frees its engine request."""

from __future__ import annotations

import asyncio
import json

from kvgen.engine.config import EngineConfig
from kvgen.replicas.asgi_call import RoutedCall, asgi_call
from kvgen.server.config import ServerConfig
from kvgen.server.launch import build
from tests.server.live import MODEL_NAME, LiveServer


def _call(body: dict, path: str = "/v1/completions") -> RoutedCall:
    return RoutedCall("POST", path, b"", ((b"content-type", b"application/json"),), json.dumps(body).encode())


async def _collect(app, call: RoutedCall, stop_after: int | None = None) -> list:
    messages = []
    stream = asgi_call(app, call)
    async for message in stream:
        messages.append(message)
        if stop_after is not None and len(messages) >= stop_after:
            await stream.aclose()  # what the ingress's cancellation does to the replica's generator
            break
    return messages


def test_responses_errors_and_early_exit_through_the_app(smollm2) -> None:
    app, engine = build(smollm2, EngineConfig(num_blocks=64), ServerConfig(MODEL_NAME))
    try:
        whole = asyncio.run(_collect(app, _call({"model": MODEL_NAME, "prompt": "The sky is", "max_tokens": 4, "temperature": 0})))
        assert whole[0][:2] == ("start", 200)
        reply = json.loads(b"".join(whole[1:]))
        assert reply["choices"][0]["text"] == smollm2.generate("The sky is", _greedy(4)).text

        refused = asyncio.run(_collect(app, _call({"model": "other", "prompt": "x"})))
        assert refused[0][1] == 404 and json.loads(b"".join(refused[1:]))["error"]["code"] == "model_not_found"

        body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 200, "stream": True, "ignore_eos": True}
        head = asyncio.run(_collect(app, _call(body), stop_after=3))
        assert dict(head[0][2])["content-type"].startswith("text/event-stream") and head[1].startswith(b"data: ")
        LiveServer(app, engine, 0).assert_no_leaks()  # the abandoned stream's request was cancelled
        cancelled = app.state.metrics.registry.get_sample_value("kvgen_requests_total", {"endpoint": "completions", "status": "cancelled"})
        generated = app.state.metrics.registry.get_sample_value("kvgen_generation_tokens_total")
        assert cancelled == 1 and generated < 100
    finally:
        engine.shutdown()


def _greedy(n: int):
    from kvgen.sampling.params import SamplingParams

    return SamplingParams(max_new_tokens=n)

"""The FastAPI app: /v1/models, /v1/completions, /v1/chat/completions, /v1/responses (SSE streaming),
/health, /metrics, the LoRA adapter routes (server/adapters.py) and /tokenize, /detokenize. Every request runs on the shared
AsyncLLMEngine; a client that disconnects cancels it. Bodies are read and parsed here (size and
nesting bounded, unknown fields refused) rather than by FastAPI, so that every failure has OpenAI's
error shape."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from kvgen.engine.async_engine import AsyncLLMEngine
from kvgen.server import adapters as adapter_routes
from kvgen.server import tokenize as tokenize_routes
from kvgen.server.config import ServerConfig
from kvgen.server.errors import APIError, install_error_handlers
from kvgen.server.limits import read_json
from kvgen.server.logprobs import prompt_logprobs
from kvgen.server.metrics import ServerMetrics
from kvgen.server.outputs import full_response, stream_events
from kvgen.server.params import build_speculative
from kvgen.server.prepare import prepare_chat, prepare_completions
from kvgen.server.protocol import REFUSED_CHAT, REFUSED_COMPLETIONS, ChatCompletionRequest, CompletionRequest, parse
from kvgen.server.responses import ResponsesAPI
from kvgen.server.serving import Serving, model_not_found, release

__all__ = ["ServerConfig", "create_app"]
log = logging.getLogger(__name__)


def create_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="kvgen", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    metrics = ServerMetrics(engine)
    serving = Serving(engine, config, metrics)
    responses = ResponsesAPI(serving)
    app.state.engine, app.state.metrics, app.state.serving = engine, metrics, serving
    keys = config.keys

    async def authorize(request: Request) -> str | None:
        """The request's API key (its tenant), or None when the server has none."""
        if not keys:
            return None
        given = request.headers.get("authorization", "")
        for key in keys:
            if secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return key
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": config.model_name}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict:
        return {"object": "list", "data": adapter_routes.model_cards(config.model_name, serving.adapters)}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorize)])
    async def model(model_id: str) -> dict:
        for card in adapter_routes.model_cards(config.model_name, serving.adapters):
            if card["id"] == model_id:
                return card
        raise model_not_found(model_id, config.model_name)

    @app.post("/v1/completions")
    async def completions(http: Request, api_key: str | None = Depends(authorize)) -> Response:
        body = parse(CompletionRequest, await read_json(http, config.limits), REFUSED_COMPLETIONS)
        adapter = serving.check_common(body)
        jobs, spec, prompt_ids = await asyncio.to_thread(prepare_completions, serving, body, adapter)
        request_id, salt, speculative = f"cmpl-{uuid.uuid4().hex}", serving.salt(api_key, body.cache_salt), build_speculative(body.speculative)
        requests = serving.validate(request_id, jobs, body.priority, salt, speculative)
        if spec.echo is not None and spec.logprobs:  # the prompt's own logprobs: one forward, engine held
            try:
                scored = await asyncio.to_thread(
                    engine.run_locked, lambda e: [prompt_logprobs(e, ids, body.logprobs, adapter) for ids in prompt_ids])
            except BaseException:
                release(requests)
                raise
            spec = dataclasses.replace(spec, prompt_logprobs=scored)
        log.info("request %s user=%r", request_id, body.user or body.safety_identifier)
        head = {"id": request_id, "created": int(time.time()), "model": body.model}  # the adapter's name when one was asked
        return await serving.respond(http, "completions", requests,
                                     stream=bool(body.stream), full=lambda r: full_response(r, head, spec) | _extra(body),
                                     events=lambda c: stream_events(c, head, spec))  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request, api_key: str | None = Depends(authorize)) -> Response:
        body = parse(ChatCompletionRequest, await read_json(http, config.limits), REFUSED_CHAT)
        adapter = serving.check_common(body)
        jobs, spec = await asyncio.to_thread(prepare_chat, serving, body, adapter)
        prediction = body.prediction.text() if body.prediction is not None else None
        request_id, salt = f"chatcmpl-{uuid.uuid4().hex}", serving.salt(api_key, body.cache_salt)
        speculative = build_speculative(body.speculative, prediction)
        requests = serving.validate(request_id, jobs, body.priority, salt, speculative)
        log.info("request %s user=%r", request_id, body.user or body.safety_identifier)
        head = {"id": request_id, "created": int(time.time()), "model": body.model}  # the adapter's name when one was asked
        if body.service_tier is not None:
            head["service_tier"] = "default"
        return await serving.respond(http, "chat", requests,
                                     stream=bool(body.stream), full=lambda r: full_response(r, head, spec) | _extra(body),
                                     events=lambda c: stream_events(c, head, spec))  # fmt: skip

    responses.install(app, authorize)
    adapter_routes.install(app, serving, authorize)
    tokenize_routes.install(app, serving, authorize)
    return app


def _extra(body) -> dict:
    """Fields echoed back: the request's metadata (as the Responses API does)."""
    return {"metadata": body.metadata} if body.metadata is not None else {}

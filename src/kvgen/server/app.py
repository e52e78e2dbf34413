"""The FastAPI app: /v1/models, /v1/completions, /v1/chat/completions (SSE streaming), /health,
/metrics. Every request runs on the shared AsyncLLMEngine; a client that disconnects cancels it."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvgen.engine.async_engine import AsyncLLMEngine
from kvgen.server.choices import ChoiceResult, collect, run_choices
from kvgen.server.errors import APIError, install_error_handlers
from kvgen.server.logprobs import chat_logprobs, completion_logprobs
from kvgen.server.metrics import ServerMetrics
from kvgen.server.params import build_params, build_speculative
from kvgen.server.protocol import ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_tokens_limit: int = 4096  # the most a request may ask for
    max_prompt_tokens: int | None = None  # default: the engine's context
    max_concurrent: int = 256  # requests served at once; more get 429


def create_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="kvgen", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    metrics = ServerMetrics(engine)
    state = {"in_flight": 0}
    app.state.engine, app.state.metrics = engine, metrics

    async def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given, f"Bearer {config.api_key}"):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    def check_model(name: str) -> None:
        if name != config.model_name:
            raise APIError(404, f"model {name!r} does not exist: this server serves {config.model_name!r} (see /v1/models)",
                           param="model", code="model_not_found")  # fmt: skip

    def admit(prompt_tokens: int) -> None:
        limit = config.max_prompt_tokens or engine.engine.max_context - 1
        if prompt_tokens > limit:
            raise APIError(400, f"the prompt has {prompt_tokens} tokens; the limit is {limit}: shorten it",
                           param="messages", code="context_length_exceeded")  # fmt: skip
        if state["in_flight"] >= config.max_concurrent:
            raise APIError(429, f"the server is serving {config.max_concurrent} requests, its limit: retry later",
                           kind="rate_limit_error", code="too_many_requests")  # fmt: skip

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": config.model_name}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0, "owned_by": "kvgen"}]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, http: Request) -> Response:
        check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported: leave it false", param="echo")
        prompt_ids = engine.engine.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        return await serve(http, "completions", body, prompt_ids, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        check_model(body.model)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        tokenizer = engine.engine.tokenizer
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        return await serve(http, "chat", body, prompt_ids, chat=True)

    async def serve(http: Request, endpoint: str, body, prompt_ids: list[int], chat: bool) -> Response:
        admit(len(prompt_ids))
        params = build_params(body, chat, config.max_tokens_limit, engine.engine)
        speculative = build_speculative(body)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:  # validate every choice before any runs: a bad request queues nothing
            for p in params:  # a speculative request builds its proposer, which checks its options
                engine.engine.make_request(request_id, prompt_ids, p, speculative=speculative).release_speculation()
        except ValueError as error:
            raise APIError(400, str(error), code="invalid_request") from error
        state["in_flight"] += 1
        metrics.running.inc()
        head = {"id": request_id, "created": int(time.time()), "model": config.model_name}
        choices = run_choices(engine, request_id, prompt_ids, params, body.priority, metrics, speculative)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = stream_events(choices, head, chat, include_usage, engine.engine.tokenizer, params[0].logprobs)
            return StreamingResponse(finish(events, endpoint), media_type="text/event-stream")
        status = "cancelled"
        try:
            results = await until_disconnect(http, collect(choices, len(params)))
            failed = [r for r in results if r.finish_reason == "error"]
            status = "error" if failed else "ok"
        finally:
            done(endpoint, status)
        if failed:
            raise APIError(500, f"generation failed: {failed[0].error}", kind="server_error")
        return JSONResponse(full_response(results, head, chat, engine.engine.tokenizer, params[0].logprobs))

    def done(endpoint: str, status: str) -> None:
        state["in_flight"] -= 1
        metrics.running.dec()
        metrics.requests.labels(endpoint, status).inc()

    async def finish(events: AsyncIterator[str], endpoint: str) -> AsyncIterator[str]:
        status = "cancelled"
        try:
            async for event in events:
                yield event
            status = "ok"
        finally:
            done(endpoint, status)

    return app


async def until_disconnect(http: Request, work):
    """Run `work`; if the client goes away first, cancel it (which cancels its engine requests)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait([task], timeout=0.25)
        if not task.done() and await http.is_disconnected():
            task.cancel()
            raise APIError(499, "client disconnected")
    return task.result()


def usage_body(results: list[ChoiceResult]) -> dict:
    prompt = results[0].prompt_tokens
    completion = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": results[0].cached_tokens}}  # fmt: skip


def logprobs_body(tokenizer, logprobs: list, chat: bool, wanted: bool, offset: int = 0) -> dict | None:
    if not wanted:
        return None
    return chat_logprobs(tokenizer, logprobs) if chat else completion_logprobs(tokenizer, logprobs, offset)


def full_response(results: list[ChoiceResult], head: dict, chat: bool, tokenizer, wanted: bool) -> dict:
    if chat:
        choices = [{"index": r.index, "message": {"role": "assistant", "content": r.text}, "finish_reason": r.finish_reason,
                    "logprobs": logprobs_body(tokenizer, r.logprobs, chat, wanted)} for r in results]  # fmt: skip
        return head | {"object": "chat.completion", "choices": choices, "usage": usage_body(results)}
    choices = [{"index": r.index, "text": r.text, "finish_reason": r.finish_reason,
                "logprobs": logprobs_body(tokenizer, r.logprobs, chat, wanted)} for r in results]  # fmt: skip
    return head | {"object": "text_completion", "choices": choices, "usage": usage_body(results)}


async def stream_events(choices, head: dict, chat: bool, include_usage: bool, tokenizer, wanted: bool) -> AsyncIterator[str]:
    """SSE: a chunk per new text (per choice), a last chunk per choice with its finish_reason, then
    (when asked) a chunk with the usage and no choices, then [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    results: dict[int, ChoiceResult] = {}
    started: set[int] = set()
    offsets: dict[int, int] = {}  # completions' text_offset goes on across chunks

    def event(choice: dict, usage: dict | None = None) -> str:
        body = head | {"object": kind, "choices": [choice] if choice else []}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    try:
        async for index, output, result in choices:
            if chat and index not in started:
                started.add(index)
                yield event({"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            if output.finish_reason == "error":
                yield f"data: {json.dumps({'error': {'message': output.error, 'type': 'server_error'}})}\n\n"
                return
            logprobs = logprobs_body(tokenizer, output.logprobs, chat, wanted, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(output.text)
            text_key = "delta" if chat else "text"
            text_value = {"content": output.text} if chat else output.text
            if output.finished:
                results[index] = result
                yield event({"index": index, text_key: text_value if output.text else ({} if chat else ""),
                             "logprobs": logprobs, "finish_reason": output.finish_reason})  # fmt: skip
            elif output.text or logprobs:
                yield event({"index": index, text_key: text_value, "logprobs": logprobs, "finish_reason": None})
    finally:  # also when the client went away: cancels what still runs
        await choices.aclose()
    if include_usage:
        yield event({}, usage_body([results[i] for i in sorted(results)]))
    yield "data: [DONE]\n\n"

"""What every generating endpoint shares: admission (concurrency, prompt length, priority), validating
every choice before any runs, running them on the engine, and the response (whole, or SSE) with the
request counted in the metrics however it ends."""

from __future__ import annotations

import asyncio
import functools
from typing import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvgen.engine.async_engine import AsyncLLMEngine
from kvgen.engine.request import Request as EngineRequest
from kvgen.lora.adapter import UnknownAdapterError
from kvgen.replies import ReplyFormat, detect_reply_format
from kvgen.result import GenerationResult
from kvgen.server.choices import Job, collect, run_choices
from kvgen.server.config import ServerConfig, tenant_salt
from kvgen.server.errors import APIError
from kvgen.server.metrics import ServerMetrics

FullRender = Callable[[list[GenerationResult]], dict]
StreamRender = Callable[[AsyncIterator], AsyncIterator[str]]


class Serving:
    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig, metrics: ServerMetrics):
        self.engine, self.config, self.metrics = engine, config, metrics
        self.limits = config.limits
        self.in_flight = 0

    @functools.cached_property
    def reply_format(self) -> ReplyFormat:
        """How the served model writes its replies (the config's, or found from the model)."""
        if self.config.reply_format != "auto":
            return self.config.reply_format  # type: ignore[return-value]
        return detect_reply_format(self.engine.engine.tokenizer)

    @property
    def prompt_limit(self) -> int:
        return min(self.config.max_prompt_tokens or self.engine.engine.max_context - 1, self.engine.engine.max_context - 1)

    @property
    def adapters(self):  # AdapterRegistry | None: the LoRA adapters the `model` field may name
        return self.engine.engine.adapters

    def check_model(self, name: str) -> str | None:
        """The LoRA adapter a request's `model` names: None for the base model (vLLM's convention),
        else a loaded adapter's name; any other name is a 404 and nothing is queued."""
        if name == self.config.model_name:
            return None
        if self.adapters is not None and name in self.adapters.names():
            return name
        raise model_not_found(name, self.config.model_name)

    def check_common(self, body) -> str | None:
        """What chat and completions check before any work: model (-> its adapter), priority, stream_options."""
        adapter = self.check_model(body.model)
        self.check_priority(body.priority)
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        return adapter

    def check_priority(self, priority: int) -> None:
        if priority and not self.config.allow_priority:
            raise APIError(400, "priority is not allowed by this server (start it with --allow-priority): leave it out",
                           param="priority", code="unsupported_parameter")  # fmt: skip

    def salt(self, api_key: str | None, cache_salt: str | None) -> str:
        return tenant_salt(api_key, cache_salt)

    def check_prompt(self, ids: list[int], param: str) -> None:
        if len(ids) > self.prompt_limit:
            raise APIError(400, f"the prompt has {len(ids)} tokens; the limit is {self.prompt_limit}: shorten it",
                           param=param, code="context_length_exceeded")  # fmt: skip

    def validate(self, request_id: str, jobs: list[Job], priority: int, salt: str, speculative) -> list[EngineRequest]:
        """Every choice's engine request, built once (choice i is `<request_id>-<i>`): a bad choice
        raises a 400 and queues nothing, and the ones built before it are released."""
        requests: list[EngineRequest] = []
        try:
            for i, (prompt_ids, params) in enumerate(jobs):  # a speculative request builds its proposer, which checks its options
                requests.append(self.engine.engine.make_request(f"{request_id}-{i}", prompt_ids, params, priority, salt, speculative))
        except UnknownAdapterError as error:  # unloaded since check_model
            release(requests)
            raise model_not_found(jobs[0][1].adapter or "", self.config.model_name) from error
        except ValueError as error:
            release(requests)
            raise APIError(400, str(error), code="invalid_request") from error
        return requests

    async def respond(self, http: Request, endpoint: str, requests: list[EngineRequest], *, stream: bool, full: FullRender,
                      events: StreamRender, on_done: Callable[[list[GenerationResult]], None] | None = None) -> Response:  # fmt: skip
        """Run the validated requests and answer: JSON from `full`, or SSE from `events`."""
        if self.in_flight >= self.config.max_concurrent:
            release(requests)
            raise APIError(429, f"the server is serving {self.config.max_concurrent} requests, its limit: retry later",
                           kind="rate_limit_error", code="too_many_requests")  # fmt: skip
        self.in_flight += 1
        self.metrics.running.inc()
        choices = run_choices(self.engine, requests, self.metrics)
        adapter = requests[0].params.adapter if requests else None
        if stream:
            return StreamingResponse(self._finish(events(choices), endpoint, adapter), media_type="text/event-stream")
        status = "cancelled"
        try:
            results = await until_disconnect(http, collect(choices, len(requests)))
            failed = [r for r in results if r.finish_reason == "error"]
            status = "error" if failed else "ok"
        finally:
            self._done(endpoint, status, adapter)
        if failed:
            raise APIError(500, f"generation failed: {failed[0].error}", kind="server_error")
        if on_done is not None:
            on_done(results)
        return JSONResponse(full(results))

    def _done(self, endpoint: str, status: str, adapter: str | None) -> None:
        self.in_flight -= 1
        self.metrics.running.dec()
        self.metrics.requests.labels(endpoint, status).inc()
        self.metrics.adapter_requests.labels(adapter or "").inc()

    async def _finish(self, events: AsyncIterator[str], endpoint: str, adapter: str | None) -> AsyncIterator[str]:
        status = "cancelled"
        try:
            async for event in events:
                yield event
            status = "ok"
        finally:
            self._done(endpoint, status, adapter)


def model_not_found(name: str, base: str) -> APIError:
    return APIError(404, f"model {name[:100]!r} does not exist: this server serves {base!r} and the LoRA adapters "
                         "listed at /v1/models", param="model", code="model_not_found")  # fmt: skip


def release(requests: list[EngineRequest]) -> None:
    """Free what built requests hold before they run (their speculative proposers)."""
    for request in requests:
        request.release_speculation()


async def until_disconnect(http: Request, work: Awaitable):
    """Run `work`; if the client goes away first, cancel it (which cancels its engine requests)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait([task], timeout=0.25)
        if not task.done() and await http.is_disconnected():
            task.cancel()
            raise APIError(499, "client disconnected")
    return task.result()

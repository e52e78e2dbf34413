"""The Responses API: POST /v1/responses (text, tools, streaming events), GET / DELETE
/v1/responses/{id}. `previous_response_id` continues a stored response: the conversation so far is
kept in memory, at most `ServerLimits.max_stored_responses` of them (the oldest dropped first), and
only for the API key that created it."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from kvgen.result import GenerationResult
from kvgen.server.config import tenant_salt
from kvgen.server.errors import APIError
from kvgen.server.limits import check_count, read_json
from kvgen.server.logprobs import chat_logprobs
from kvgen.server.params import Sampling, build_params, build_speculative, json_schema_output
from kvgen.replies import reply_parser, skips_special_tokens
from kvgen.replies.formats import starts_in_reasoning
from kvgen.server.prepare import render_chat_prompt, template_variables
from kvgen.server.protocol import parse
from kvgen.server.replies import ReplyStream, reasoning_tokens
from kvgen.server.reply_grammar import reply_grammar
from kvgen.server.response_items import ItemStream, output_items, output_messages
from kvgen.server.responses_protocol import (OUTPUT_TEXT_LOGPROBS, REFUSED_RESPONSES, FunctionCallItem, FunctionChoice,
                                             InputMessage, ReasoningItem, ResponsesRequest)  # fmt: skip
from kvgen.server.tools import Tool, ToolPlan, make_plan


@dataclass
class Stored:
    tenant: str
    conversation: list[dict[str, Any]]  # chat messages, the response's output included
    body: dict[str, Any]


class ResponsesAPI:
    def __init__(self, serving):
        self.serving = serving
        self.store: OrderedDict[str, Stored] = OrderedDict()

    def install(self, app: FastAPI, authorize) -> None:
        @app.post("/v1/responses")
        async def create(http: Request, api_key: str | None = Depends(authorize)) -> Response:
            return await self.create(http, api_key)

        @app.get("/v1/responses/{response_id}")
        async def retrieve(response_id: str, api_key: str | None = Depends(authorize)) -> dict:
            return self._stored(response_id, api_key, "response_id").body

        @app.delete("/v1/responses/{response_id}")
        async def delete(response_id: str, api_key: str | None = Depends(authorize)) -> dict:
            self._stored(response_id, api_key, "response_id")
            del self.store[response_id]
            return {"id": response_id, "object": "response", "deleted": True}

    def _stored(self, response_id: str, api_key: str | None, param: str) -> Stored:
        stored = self.store.get(response_id)
        if stored is None or stored.tenant != tenant_salt(api_key, None):  # another tenant's: as if absent
            raise APIError(404 if param == "response_id" else 400, f"response {response_id[:100]!r} not found", param=param)
        return stored

    async def create(self, http: Request, api_key: str | None) -> Response:
        serving = self.serving
        body = parse(ResponsesRequest, await read_json(http, serving.limits), REFUSED_RESPONSES)
        adapter = serving.check_model(body.model)
        serving.check_priority(body.priority)
        history = self._stored(body.previous_response_id, api_key, "previous_response_id").conversation if body.previous_response_id else []
        conversation = history + input_messages(body.input)
        if not any(m["role"] != "system" for m in conversation):
            raise APIError(400, "input is empty: give the text or items to respond to", param="input")
        check_count("input", len(conversation), serving.limits.max_messages)
        plan = _plan(body, serving.limits)
        _check_logprobs(body, plan, serving.reply_format)
        prompt = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
        tokenizer, reply_format = serving.engine.engine.tokenizer, serving.reply_format
        answer = await asyncio.to_thread(_answer_format, body, plan)
        variables = template_variables(tokenizer, None, body.reasoning.effort if body.reasoning else None, "reasoning.effort")
        ids, prompt_text = await asyncio.to_thread(render_chat_prompt, tokenizer, prompt, plan, serving.prompt_limit, "input", variables)
        structured = await asyncio.to_thread(reply_grammar, reply_format, plan, answer, starts_in_reasoning(prompt_text), "text.format")
        sampling = Sampling(max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p, adapter=adapter,
                            skip_special_tokens=skips_special_tokens(reply_format), logprobs=body.wants_logprobs,
                            top_logprobs=body.top_logprobs or 0, top_k=body.top_k, logit_bias=body.logit_bias)  # fmt: skip
        params = build_params(sampling, "responses", serving.config.max_tokens_limit, serving.engine.engine, serving.limits, structured)
        request_id, salt, speculative = f"resp_{uuid.uuid4().hex}", serving.salt(api_key, body.cache_salt), build_speculative(body.speculative)
        jobs = [(ids, params[0])]
        requests = serving.validate(request_id, jobs, body.priority, salt, speculative)
        shell = _shell(request_id, body, plan)

        def reply() -> ReplyStream:
            return ReplyStream(reply_parser(reply_format, prompt_text), plan)

        def finish(result: GenerationResult, output: list[dict]) -> dict:
            thinking = reasoning_tokens(tokenizer, reply(), result.token_ids, skip_special_tokens=skips_special_tokens(reply_format))
            done = _completed(shell, result, output, thinking)
            if body.store is not False:
                self._keep(request_id, Stored(tenant_salt(api_key, None), conversation + output_messages(output), done))
            return done

        def token_logprobs(logprobs: list | None) -> list[dict] | None:
            return chat_logprobs(tokenizer, logprobs or [])["content"] if body.wants_logprobs else None

        def full(results: list[GenerationResult]) -> dict:
            return finish(results[0], output_items(reply(), results[0].text, token_logprobs(results[0].logprobs)))

        return await serving.respond(http, "responses", requests, stream=bool(body.stream), full=full,
                                     events=lambda c: stream(c, shell, reply(), finish, token_logprobs))  # fmt: skip

    def _keep(self, response_id: str, stored: Stored) -> None:
        self.store[response_id] = stored
        while len(self.store) > self.serving.limits.max_stored_responses:
            self.store.popitem(last=False)


def _plan(body: ResponsesRequest, limits) -> ToolPlan:
    check_count("tools", len(body.tools or []), limits.max_tools)
    tools = [Tool(t.name, t.description, t.parameters or {"type": "object", "properties": {}}) for t in body.tools or []]
    choice = body.tool_choice.name if isinstance(body.tool_choice, FunctionChoice) else body.tool_choice
    return make_plan(tools, choice, body.parallel_tool_calls)


def _check_logprobs(body: ResponsesRequest, plan: ToolPlan, reply_format: str) -> None:
    """Logprobs are the output text's tokens: a 400 where they are asked for in a way kvgen cannot
    give (top_logprobs without including them; replies whose tokens are not all the message's)."""
    if body.top_logprobs and not body.wants_logprobs:
        raise APIError(400, f"top_logprobs needs include: [{OUTPUT_TEXT_LOGPROBS!r}]", param="top_logprobs")
    if body.wants_logprobs and (plan.active or reply_format != "plain"):
        why = "tools are active" if plan.active else f"the served model's replies are {reply_format!r}, not plain text"
        raise APIError(400, f"{OUTPUT_TEXT_LOGPROBS} is given for plain text replies only, and here {why}: leave it out of include",
                       param="include")  # fmt: skip


def _answer_format(body: ResponsesRequest, plan: ToolPlan):
    """text.format's StructuredOutput (None for text); it cannot be combined with active tools."""
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if plan.active:
        raise APIError(400, "text.format cannot be combined with tools (unless tool_choice is 'none')", param="text.format")
    if fmt.type == "json_object":
        return json_schema_output({"type": "object"}, "text.format")
    if fmt.schema_ is None:
        raise APIError(400, "text.format json_schema needs a schema", param="text.format.schema")
    return json_schema_output(fmt.schema_, "text.format.schema")


def input_messages(items: str | list) -> list[dict[str, Any]]:
    """Responses input items -> chat messages (function calls grouped into one assistant turn, a
    reasoning item joined to the assistant turn after it)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning += [part.text for part in item.content or []]
            continue
        if isinstance(item, InputMessage):
            messages.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1] and not reasoning:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
        if reasoning and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = messages[-1]["thinking"] = "".join(reasoning)
            reasoning = []
    return messages


def _shell(response_id: str, body: ResponsesRequest, plan: ToolPlan) -> dict[str, Any]:
    """The response object before any output (what response.created carries)."""
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else {"type": "text"}
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, FunctionChoice) else (body.tool_choice or "auto")
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress", "error": None,
        "incomplete_details": None, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "model": body.model, "output": [], "parallel_tool_calls": plan.parallel, "previous_response_id": body.previous_response_id,
        "temperature": 1.0 if body.temperature is None else body.temperature, "top_p": 1.0 if body.top_p is None else body.top_p,
        "tool_choice": choice, "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "text": {"format": fmt}, "truncation": "disabled", "store": body.store is not False, "metadata": body.metadata or {},
        "user": body.user, "usage": None,
    }  # fmt: skip


def _completed(shell: dict, result: GenerationResult, output: list[dict], thinking: int) -> dict[str, Any]:
    incomplete = result.finish_reason == "length"
    used = result.usage
    usage = {"input_tokens": used.prompt_tokens, "input_tokens_details": {"cached_tokens": used.cached_tokens},
             "output_tokens": used.completion_tokens, "output_tokens_details": {"reasoning_tokens": thinking},
             "total_tokens": used.total_tokens}  # fmt: skip
    return shell | {"status": "incomplete" if incomplete else "completed", "output": output, "usage": usage,
                    "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None}  # fmt: skip


async def stream(choices, shell: dict, reply: ReplyStream, finish, token_logprobs) -> AsyncIterator[str]:
    """The Responses event stream: created, in_progress, per output item added / deltas / done,
    then completed (or incomplete)."""
    counter = iter(range(1 << 62))

    def event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(counter), **fields})}\n\n"

    yield event("response.created", response=shell)
    yield event("response.in_progress", response=shell)
    items = ItemStream(event, reply)
    try:
        async for _, output in choices:
            if output.finish_reason == "error":
                yield event("error", code="server_error", message=output.error, param=None)
                return
            for chunk in items.feed(output.text, output.finished, token_logprobs(output.logprobs)):
                yield chunk
            if output.finished:
                for chunk in items.close():
                    yield chunk
                done = finish(output.result, items.output)
                yield event("response.incomplete" if done["status"] == "incomplete" else "response.completed", response=done)
    finally:
        await choices.aclose()

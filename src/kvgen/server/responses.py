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
from kvgen.server.params import Sampling, build_params, build_speculative, json_schema_output
from kvgen.server.prepare import render_chat_prompt
from kvgen.server.protocol import parse
from kvgen.server.responses_protocol import REFUSED_RESPONSES, FunctionChoice, InputMessage, FunctionCallItem, ResponsesRequest
from kvgen.server.tools import ParsedCall, Tool, ToolCallStream, ToolPlan, make_plan, parse_calls


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
        prompt = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
        structured = await asyncio.to_thread(_structured, body, plan)
        ids = await asyncio.to_thread(render_chat_prompt, serving.engine.engine.tokenizer, prompt, plan, serving.prompt_limit, "input")
        sampling = Sampling(max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p, adapter=adapter)
        params = build_params(sampling, "responses", serving.config.max_tokens_limit, serving.engine.engine, serving.limits, structured)
        request_id, salt, speculative = f"resp_{uuid.uuid4().hex}", serving.salt(api_key, body.cache_salt), build_speculative(body.speculative)
        jobs = [(ids, params[0])]
        requests = serving.validate(request_id, jobs, body.priority, salt, speculative)
        shell = _shell(request_id, body, plan)

        def finish(result: GenerationResult, output: list[dict]) -> dict:
            done = _completed(shell, result, output)
            if body.store is not False:
                self._keep(request_id, Stored(tenant_salt(api_key, None), conversation + output_messages(output), done))
            return done

        def full(results: list[GenerationResult]) -> dict:
            return finish(results[0], output_items(results[0].text, plan))

        return await serving.respond(http, "responses", requests, stream=bool(body.stream), full=full, events=lambda c: stream(c, shell, plan, finish))  # fmt: skip

    def _keep(self, response_id: str, stored: Stored) -> None:
        self.store[response_id] = stored
        while len(self.store) > self.serving.limits.max_stored_responses:
            self.store.popitem(last=False)


def _plan(body: ResponsesRequest, limits) -> ToolPlan:
    check_count("tools", len(body.tools or []), limits.max_tools)
    tools = [Tool(t.name, t.description, t.parameters or {"type": "object", "properties": {}}) for t in body.tools or []]
    choice = body.tool_choice.name if isinstance(body.tool_choice, FunctionChoice) else body.tool_choice
    return make_plan(tools, choice, body.parallel_tool_calls)


def _structured(body: ResponsesRequest, plan: ToolPlan):
    structured = plan.structured()
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return structured
    if structured is not None:
        raise APIError(400, "text.format cannot be combined with tools (unless tool_choice is 'none')", param="text.format")
    if fmt.type == "json_object":
        return json_schema_output({"type": "object"}, "text.format")
    if fmt.schema_ is None:
        raise APIError(400, "text.format json_schema needs a schema", param="text.format.schema")
    return json_schema_output(fmt.schema_, "text.format.schema")


def input_messages(items: str | list) -> list[dict[str, Any]]:
    """Responses input items -> chat messages (function calls grouped into one assistant turn)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, InputMessage):
            messages.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
    return messages


def output_items(text: str, plan: ToolPlan) -> list[dict[str, Any]]:
    is_calls, calls = parse_calls(text, final=True) if plan.active else (False, [])
    if is_calls:
        return [_call_item(c, "completed" if c.complete else "incomplete") for c in calls]
    return [_message_item(f"msg_{uuid.uuid4().hex}", text, "completed")]


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items as chat history (for previous_response_id)."""
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]  # fmt: skip
    if calls:
        return [{"role": "assistant", "content": "", "tool_calls": calls}]
    return [{"role": "assistant", "content": "".join(p["text"] for i in output for p in i["content"])}]


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(call: ParsedCall, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status != "in_progress" else "", "status": status}  # fmt: skip


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


def _completed(shell: dict, result: GenerationResult, output: list[dict]) -> dict[str, Any]:
    incomplete = result.finish_reason == "length"
    used = result.usage
    usage = {"input_tokens": used.prompt_tokens, "input_tokens_details": {"cached_tokens": used.cached_tokens},
             "output_tokens": used.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": used.total_tokens}  # fmt: skip
    return shell | {"status": "incomplete" if incomplete else "completed", "output": output, "usage": usage,
                    "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None}  # fmt: skip


async def stream(choices, shell: dict, plan: ToolPlan, finish) -> AsyncIterator[str]:
    """The Responses event stream: created, in_progress, per output item added / deltas / done,
    then completed (or incomplete)."""
    counter = iter(range(1 << 62))

    def event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(counter), **fields})}\n\n"

    yield event("response.created", response=shell)
    yield event("response.in_progress", response=shell)
    items = _ItemStream(event, plan)
    try:
        async for _, output in choices:
            if output.finish_reason == "error":
                yield event("error", code="server_error", message=output.error, param=None)
                return
            for chunk in items.feed(output.text, output.finished):
                yield chunk
            if output.finished:
                for chunk in items.close():
                    yield chunk
                done = finish(output.result, items.output)
                yield event("response.incomplete" if done["status"] == "incomplete" else "response.completed", response=done)
    finally:
        await choices.aclose()


class _ItemStream:
    """Generated text -> output items' events (a message with one output_text part, or calls)."""

    def __init__(self, event, plan: ToolPlan):
        self.event, self.tools = event, ToolCallStream() if plan.active else None
        self.message_id, self.text, self.output = f"msg_{uuid.uuid4().hex}", "", []
        self.calls: list[ParsedCall] = []
        self.started = False

    def feed(self, piece: str, final: bool) -> list[str]:
        delta = self.tools.feed(piece, final) if self.tools else ({"content": piece} if piece else {})
        out = []
        if "content" in delta:
            if not self.started:
                out += self._start_message()
            self.text += delta["content"]
            out.append(self.event("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                                  delta=delta["content"], logprobs=[]))  # fmt: skip
        for part in delta.get("tool_calls", []):
            index = part["index"]
            if "id" in part:
                if self.calls:
                    out += self._call_done(len(self.calls) - 1)
                self.calls.append(self.tools.calls[index])
                out.append(self.event("response.output_item.added", output_index=index, item=_call_item(self.calls[index], "in_progress")))
            elif part["function"]["arguments"]:
                item_id = _call_item(self.calls[index], "in_progress")["id"]
                out.append(self.event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                                      delta=part["function"]["arguments"]))  # fmt: skip
        return out

    def _start_message(self) -> list[str]:
        self.started = True
        return [self.event("response.output_item.added", output_index=0, item=_message_item(self.message_id, "", "in_progress")),
                self.event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                           part={"type": "output_text", "text": "", "annotations": []})]  # fmt: skip

    def _call_done(self, index: int) -> list[str]:
        item = _call_item(self.calls[index], "completed" if self.calls[index].complete else "incomplete")
        self.output.append(item)
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index, name=item["name"],
                           arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]  # fmt: skip

    def close(self) -> list[str]:
        if self.calls:
            return self._call_done(len(self.calls) - 1)
        out = []
        if not self.started:  # an empty message still gets its item and part
            out += self._start_message()
        item = _message_item(self.message_id, self.text, "completed")
        self.output.append(item)
        part = item["content"][0]
        return out + [
            self.event("response.output_text.done", item_id=self.message_id, output_index=0, content_index=0, text=self.text, logprobs=[]),
            self.event("response.content_part.done", item_id=self.message_id, output_index=0, content_index=0, part=part),
            self.event("response.output_item.done", output_index=0, item=item),
        ]  # fmt: skip

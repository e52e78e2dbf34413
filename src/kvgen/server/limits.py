"""What one request may ask of the server, checked before any work: body size, JSON nesting, counts
of messages / stop strings / tools / prompts, and the prompt length (probed before the whole prompt
is tokenized). Every refusal is an OpenAI-shaped 4xx naming what was too big."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from fastapi import Request

from kvgen.server.errors import APIError


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 8 * 1024 * 1024  # a larger body is a 413 before it is parsed
    max_json_depth: int = 64  # nesting of the request JSON (tool schemas included)
    max_messages: int = 1024
    max_stop: int = 4  # as OpenAI
    max_stop_chars: int = 256
    max_tools: int = 128  # as OpenAI
    max_prompts: int = 64  # completions: prompts in one request
    max_choices: int = 64  # prompts x n
    max_logit_bias: int = 300
    max_stop_token_ids: int = 64  # vLLM's stop_token_ids extension
    max_top_logprobs: int = 20
    max_stored_responses: int = 1024  # Responses API: kept in memory for previous_response_id

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"server limit {f.name} must be a positive integer, got {value!r}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"server limit max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.max_top_logprobs > 20:
            raise ValueError(f"server limit max_top_logprobs must be at most 20 (what logprobs report), got {self.max_top_logprobs}")


async def read_json(request: Request, limits: ServerLimits) -> dict[str, Any]:
    """The body as a JSON object: 413 past max_body_bytes (read no further), 400 when it is not JSON,
    not an object, or nested deeper than max_json_depth."""
    raw = await read_body(request, limits)
    # A large body is parsed off the event loop, so one client's megabytes never stall the others.
    return await asyncio.to_thread(parse_json, raw, limits) if len(raw) > 65536 else parse_json(raw, limits)


async def read_body(request: Request, limits: ServerLimits) -> bytes:
    """The raw body; 413 past max_body_bytes, reading no further."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise _too_large(limits)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise _too_large(limits)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes, limits: ServerLimits) -> dict[str, Any]:
    if _depth_bound_exceeded(raw, limits.max_json_depth):  # before json.loads, which recurses
        raise APIError(400, f"the request JSON is nested deeper than {limits.max_json_depth} levels", code="invalid_json")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise APIError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw):  # JSON allows "\ud800" alone; a tokenizer cannot take it
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "a string in the request holds a lone UTF-16 surrogate escape (\\udXXX): send valid Unicode",
                           code="invalid_json") from None  # fmt: skip
    return body


def _too_large(limits: ServerLimits) -> APIError:
    return APIError(413, f"the request body is larger than {limits.max_body_bytes} bytes, this server's limit",
                    code="request_too_large")  # fmt: skip


def _depth_bound_exceeded(raw: bytes, max_depth: int) -> bool:
    """Whether brackets outside strings nest deeper than max_depth, in C-speed passes (regex, translate,
    numpy) so that a body of megabytes of brackets costs milliseconds, not a Python loop."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return False
    outside = _JSON_STRING.sub(b"", raw)
    brackets = np.frombuffer(outside.translate(None, _NOT_BRACKETS), dtype=np.uint8)
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1)
    return bool(steps.size) and int(np.cumsum(steps).max()) > max_depth


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def check_count(name: str, count: int, limit: int) -> None:
    if count > limit:
        raise APIError(400, f"{name} has {count} entries; this server allows at most {limit}", param=name)


def encode_bounded(tokenizer, text: str, limit: int, param: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`, refusing a prompt longer than `limit` tokens without tokenizing all of a
    huge one: a token covers at most a few dozen characters in practice, so a text that is long in
    characters is probed on its head first (cut text tokenizes to at least its tokens minus one)."""
    probe_chars = (limit + 2) * 32
    if len(text) > probe_chars:
        head = _encode(tokenizer, text[:probe_chars], add_special_tokens, param)
        if len(head) > limit + 1:
            raise prompt_too_long(f"more than {limit}", limit, param)
    ids = _encode(tokenizer, text, add_special_tokens, param)
    if len(ids) > limit:
        raise prompt_too_long(str(len(ids)), limit, param)
    return ids


def _encode(tokenizer, text: str, add_special_tokens: bool, param: str) -> list[int]:
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except Exception as error:  # noqa: BLE001 - whatever the tokenizer cannot take is the input's fault
        raise APIError(400, f"the tokenizer cannot encode this {param}: {error}", param=param) from None


def prompt_too_long(count: str, limit: int, param: str) -> APIError:
    return APIError(400, f"the prompt has {count} tokens; the limit is {limit}: shorten it", param=param,
                    code="context_length_exceeded")  # fmt: skip

"""POST /tokenize and /detokenize (vLLM's shapes): the served model's token ids for a text or a
conversation, and the text of token ids, so that a client can count a prompt before it sends it."""

from __future__ import annotations

import asyncio
import sys
from typing import Any, Callable

from fastapi import Depends, FastAPI, Request
from pydantic import Field

from kvgen.prompt_checks import outside_vocabulary
from kvgen.server.errors import APIError
from kvgen.server.limits import check_count, read_json
from kvgen.server.prepare import chat_tools, message_dict, render_chat_prompt, template_variables
from kvgen.server.protocol import ChatMessage, ChatTool, Strict, parse


class TokenizeRequest(Strict):
    model: str | None = Field(default=None, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # a text: default true (BOS as the model wants); a conversation: its template's
    add_generation_prompt: bool = True  # a conversation: end with the assistant turn's opening, as a chat request does
    tools: list[ChatTool] | None = None  # a conversation: the tools its template shows
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False  # also each token's text as the vocabulary spells it


class DetokenizeRequest(Strict):
    model: str | None = Field(default=None, max_length=256)
    tokens: list[int]


def install(app: FastAPI, serving, authorize: Callable) -> None:
    """The routes on `app` (serving: the app's Serving; authorize: its API-key dependency)."""

    @app.post("/tokenize", dependencies=[Depends(authorize)])
    async def tokenize(http: Request) -> dict:
        body = parse(TokenizeRequest, await read_json(http, serving.limits), {})
        if body.model is not None:
            serving.check_model(body.model)
        ids = await asyncio.to_thread(_token_ids, serving, body)
        tokenizer = serving.engine.engine.tokenizer
        strings = [tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": serving.engine.engine.max_context, "tokens": ids, "token_strs": strings}

    @app.post("/detokenize", dependencies=[Depends(authorize)])
    async def detokenize(http: Request) -> dict:
        body = parse(DetokenizeRequest, await read_json(http, serving.limits), {})
        if body.model is not None:
            serving.check_model(body.model)
        tokenizer = serving.engine.engine.tokenizer
        if bad := outside_vocabulary(body.tokens, tokenizer.vocab_size):
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0 to {tokenizer.vocab_size - 1})", param="tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens, skip_special_tokens=False)}


def _token_ids(serving, body: TokenizeRequest) -> list[int]:
    tokenizer = serving.engine.engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt (a text) or messages (a conversation), not both or neither", param="prompt")
    if body.prompt is not None:
        for name in ("tools", "chat_template_kwargs", "add_generation_prompt"):
            if name in body.model_fields_set and getattr(body, name) is not None:
                raise APIError(400, f"{name} applies to messages, not to a prompt", param=name)
        return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    if body.add_special_tokens:
        raise APIError(400, "add_special_tokens: a conversation's special tokens are the ones its chat template writes; "
                            "leave it out", param="add_special_tokens")  # fmt: skip
    check_count("messages", len(body.messages), serving.limits.max_messages)
    plan = chat_tools(body.tools, None, None, serving.limits)
    variables = template_variables(tokenizer, body.chat_template_kwargs, None)
    variables["add_generation_prompt"] = body.add_generation_prompt
    # No bound on length here: the body's size bounds the work, and a count past the context is an answer.
    ids, _ = render_chat_prompt(tokenizer, [message_dict(m) for m in body.messages], plan, sys.maxsize,
                                template_kwargs=variables)  # fmt: skip
    return ids

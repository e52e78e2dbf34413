"""Finished choices -> OpenAI response bodies, and choice events -> SSE chunks, for chat completions
(content or tool calls) and completions (with echo and prompt logprobs)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

from kvgen.replies import ReplyFormat, reply_parser, skips_special_tokens
from kvgen.result import GenerationResult
from kvgen.server.logprobs import chat_logprobs, completion_logprobs
from kvgen.server.replies import ReplyStream, reasoning_tokens
from kvgen.server.tools import ToolPlan


@dataclass(frozen=True)
class OutputSpec:
    chat: bool
    n: int  # choices per prompt
    tokenizer: Any
    logprobs: bool
    plan: ToolPlan | None = None
    echo: list[str] | None = None  # completions: each prompt's text, written before its choices
    prompt_logprobs: list[dict] | None = None  # completions echo + logprobs: each prompt's columns
    include_usage: bool = False
    reply_format: ReplyFormat = "plain"  # chat: how the model writes reasoning and calls
    prompt_text: str = ""  # chat: the rendered prompt (a generation prompt may open the reasoning)
    prediction: bool = False  # chat: the request brought a prediction (usage counts its drafts)

    def reply_stream(self) -> ReplyStream:
        """A fresh parser of one chat choice's text."""
        return ReplyStream(reply_parser(self.reply_format, self.prompt_text), self.plan)

    def reasoning_tokens(self, result: GenerationResult) -> int:
        if not self.chat or self.reply_format == "plain":
            return 0
        return reasoning_tokens(self.tokenizer, self.reply_stream(), result.token_ids, skips_special_tokens(self.reply_format))

    def logprobs_body(self, logprobs: list, offset: int = 0) -> dict | None:
        if not self.logprobs:
            return None
        return chat_logprobs(self.tokenizer, logprobs) if self.chat else completion_logprobs(self.tokenizer, logprobs, offset)

    def finish_reason(self, reason: str | None, called_tools: bool) -> str | None:
        return "tool_calls" if called_tools and reason == "stop" else reason


def usage_body(results: list[GenerationResult], spec: OutputSpec) -> dict:
    """The prompt counted once per prompt (choices i*n .. i*n+n-1 share prompt i)."""
    firsts = results[:: spec.n]
    prompt = sum(r.usage.prompt_tokens for r in firsts)
    completion = sum(r.usage.completion_tokens for r in results)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": sum(r.usage.cached_tokens for r in firsts)}}  # fmt: skip
    if spec.chat:
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(spec.reasoning_tokens(r) for r in results)}
    if spec.prediction:  # drafted tokens the verify kept and those it rejected (from the prediction or the context)
        stats = [r.speculative for r in results if r.speculative is not None]
        accepted = sum(s.accepted_tokens for s in stats)
        usage["completion_tokens_details"] |= {"accepted_prediction_tokens": accepted,
                                               "rejected_prediction_tokens": sum(s.proposed_tokens for s in stats) - accepted}  # fmt: skip
    return usage


def _echoed_logprobs(spec: OutputSpec, prompt: int, generated: dict | None) -> dict | None:
    """Completions echo: the prompt's logprob columns, then the generated ones (offsets shifted)."""
    if generated is None or spec.prompt_logprobs is None:
        return generated
    head = spec.prompt_logprobs[prompt]
    shift = len(spec.echo[prompt]) if spec.echo else 0
    return {"tokens": head["tokens"] + generated["tokens"], "token_logprobs": head["token_logprobs"] + generated["token_logprobs"],
            "top_logprobs": head["top_logprobs"] + generated["top_logprobs"],
            "text_offset": head["text_offset"] + [o + shift for o in generated["text_offset"]]}  # fmt: skip


def full_response(results: list[GenerationResult], head: dict, spec: OutputSpec) -> dict:
    if spec.chat:
        choices = []
        for index, r in enumerate(results):
            fields = spec.reply_stream().message(r.text)
            called = "tool_calls" in fields
            choices.append({"index": index, "message": {"role": "assistant", **fields},
                            "finish_reason": spec.finish_reason(r.finish_reason, called), "logprobs": spec.logprobs_body(r.logprobs or [])})  # fmt: skip
        return head | {"object": "chat.completion", "choices": choices, "usage": usage_body(results, spec)}
    choices = []
    for index, r in enumerate(results):
        prompt = index // spec.n
        echo = spec.echo[prompt] if spec.echo else ""
        logprobs = _echoed_logprobs(spec, prompt, spec.logprobs_body(r.logprobs or [], len(echo)))
        choices.append({"index": index, "text": echo + r.text, "finish_reason": r.finish_reason, "logprobs": logprobs})
    return head | {"object": "text_completion", "choices": choices, "usage": usage_body(results, spec)}


async def stream_events(choices, head: dict, spec: OutputSpec) -> AsyncIterator[str]:
    """SSE: a chunk per new text (per choice), a last chunk per choice with its finish_reason, then
    (when asked) a chunk with the usage and no choices, then [DONE]."""
    kind = "chat.completion.chunk" if spec.chat else "text_completion"
    results: dict[int, GenerationResult] = {}
    started: set[int] = set()
    offsets: dict[int, int] = {}  # completions' text_offset goes on across chunks
    replies: dict[int, ReplyStream] = {}

    def event(choice: dict | None, usage: dict | None = None) -> str:
        body = head | {"object": kind, "choices": [choice] if choice else []}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    try:
        async for index, output in choices:
            if index not in started:
                started.add(index)
                first = _first_chunk(spec, index)
                if first is not None:
                    offsets[index] = len(first.get("text", ""))
                    yield event(first)
            if output.finish_reason == "error":
                yield f"data: {json.dumps({'error': {'message': output.error, 'type': 'server_error'}})}\n\n"
                return
            logprobs = spec.logprobs_body(output.logprobs, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(output.text)
            if spec.chat:
                reply = replies.setdefault(index, spec.reply_stream())
                delta, called = reply.feed(output.text, output.finished), bool(reply.calls)
            else:
                delta, called = output.text, False
            text_key = "delta" if spec.chat else "text"
            if output.finished:
                results[index] = output.result
                yield event({"index": index, text_key: delta, "logprobs": logprobs,
                             "finish_reason": spec.finish_reason(output.finish_reason, called)})  # fmt: skip
            elif delta or logprobs:
                yield event({"index": index, text_key: delta, "logprobs": logprobs, "finish_reason": None})
    finally:  # also when the client went away: cancels what still runs
        await choices.aclose()
    if spec.include_usage:
        yield event(None, usage_body([results[i] for i in sorted(results)], spec))
    yield "data: [DONE]\n\n"


def _first_chunk(spec: OutputSpec, index: int) -> dict | None:
    if spec.chat:
        content = None if spec.plan is not None and spec.plan.active else ""
        return {"index": index, "delta": {"role": "assistant", "content": content}, "logprobs": None, "finish_reason": None}
    if spec.echo:
        prompt = index // spec.n
        logprobs = spec.prompt_logprobs[prompt] if spec.prompt_logprobs else None
        return {"index": index, "text": spec.echo[prompt], "logprobs": logprobs, "finish_reason": None}
    return None

"""Running the choices of one API request on the engine, as one stream of outputs.

Choice i is its own engine request (id `<request>-<i>`) with its own prompt and params (completions
may send several prompts, each with n choices); choices of one prompt share it through the prefix
cache. Closing the stream (a client that went away) cancels every choice still running.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from kvgen.engine.async_engine import AsyncLLMEngine
from kvgen.engine.request import RequestOutput
from kvgen.sampling.params import SamplingParams
from kvgen.sampling.sampler import TokenLogprob
from kvgen.speculative.config import SpeculativeConfig


@dataclass
class ChoiceResult:
    index: int
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


Event = tuple[int, RequestOutput, ChoiceResult]


Job = tuple[list[int], SamplingParams]  # one choice: prompt ids, params


async def _one_choice(engine: AsyncLLMEngine, request_id: str, index: int, job: Job, priority: int, metrics,
                      speculative: SpeculativeConfig | None, salt: str) -> AsyncIterator[Event]:  # fmt: skip
    result, pieces = ChoiceResult(index), []
    started = last = time.perf_counter()
    prompt_ids, params = job
    async for output in engine.generate(f"{request_id}-{index}", prompt_ids, params, priority, salt, speculative):
        now = time.perf_counter()
        if output.token_ids:
            if not result.completion_tokens and not pieces:
                metrics.ttft.observe(now - started)
            else:
                metrics.itl.observe(now - last)
            metrics.generation_tokens.inc(len(output.token_ids))
            last = now
        pieces.append(output.text)
        result.logprobs.extend(output.logprobs)
        if output.finished:
            result.text, result.finish_reason, result.error = "".join(pieces), output.finish_reason, output.error
            if output.usage is not None:
                result.prompt_tokens, result.completion_tokens = output.usage.prompt_tokens, output.usage.completion_tokens
                result.cached_tokens = output.usage.cached_tokens
                metrics.prompt_tokens.inc(output.usage.prompt_tokens)
        yield index, output, result


async def run_choices(engine: AsyncLLMEngine, request_id: str, jobs: list[Job], priority: int, metrics,
                      speculative: SpeculativeConfig | None = None, salt: str = "") -> AsyncIterator[Event]:  # fmt: skip
    streams = [_one_choice(engine, request_id, i, job, priority, metrics, speculative, salt) for i, job in enumerate(jobs)]
    if len(streams) == 1:
        try:
            async for event in streams[0]:
                yield event
        finally:
            await streams[0].aclose()
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(stream) -> None:
        try:
            async for event in stream:
                await merged.put(event)
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    remaining = len(streams)
    try:
        while remaining:
            event = await merged.get()
            remaining -= event[1].finished
            yield event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(choices: AsyncIterator[Event], count: int) -> list[ChoiceResult]:
    results: dict[int, ChoiceResult] = {}
    try:
        async for index, output, result in choices:
            if output.finished:
                results[index] = result
    finally:
        await choices.aclose()
    return [results[i] for i in range(count)]

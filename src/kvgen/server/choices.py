"""Running the choices of one API request on the engine, as one stream of outputs.

Choice i is its own engine request (id `<request>-<i>`, built and validated once by
`Serving.validate`) with its own prompt and params (completions may send several prompts, each with
n choices); choices of one prompt share it through the prefix cache. The last output of a choice
carries its `GenerationResult`. Closing the stream (a client that went away) cancels every choice
still running.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from kvgen.engine.async_engine import AsyncLLMEngine
from kvgen.engine.request import Request, RequestOutput
from kvgen.result import GenerationResult
from kvgen.sampling.params import SamplingParams

Event = tuple[int, RequestOutput]  # choice index, what the engine produced for it

Job = tuple[list[int], SamplingParams]  # one choice: prompt ids, params


async def _one_choice(engine: AsyncLLMEngine, index: int, request: Request, metrics) -> AsyncIterator[Event]:
    started = last = time.perf_counter()
    produced = False
    adapter_tokens = metrics.adapter_generation_tokens.labels(request.params.adapter or "")  # once, not per chunk
    async for output in engine.run(request):
        now = time.perf_counter()
        if output.token_ids:
            if produced:
                metrics.itl.observe(now - last)
            else:
                metrics.ttft.observe(now - started)
            metrics.generation_tokens.inc(len(output.token_ids))
            adapter_tokens.inc(len(output.token_ids))
            produced, last = True, now
        if output.finished and output.usage is not None:
            metrics.prompt_tokens.inc(output.usage.prompt_tokens)
        yield index, output


async def run_choices(engine: AsyncLLMEngine, requests: list[Request], metrics) -> AsyncIterator[Event]:
    streams = [_one_choice(engine, i, request, metrics) for i, request in enumerate(requests)]
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


async def collect(choices: AsyncIterator[Event], count: int) -> list[GenerationResult]:
    """Every choice's result, in choice order."""
    results: dict[int, GenerationResult] = {}
    try:
        async for index, output in choices:
            if output.finished:
                results[index] = output.result
    finally:
        await choices.aclose()
    return [results[i] for i in range(count)]

"""Batched generation for library users: several prompts decoded together, one forward per step.

It runs the continuous-batching engine (engine/engine.py) to completion: every step is one
`forward_batch` over all unfinished prompts (ragged, per-row positions and masks, each prompt in its
own paged cache), so N prompts cost about one weight read per step instead of N. Greedy results are
the tokens each prompt gets alone (tests/unit/test_generate_batch.py).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Sequence

from kvgen.engine import EngineConfig, LLMEngine
from kvgen.result import GenerationResult
from kvgen.sampling.params import SamplingParams

_batch_ids = itertools.count()


class BatchGenerator:
    """Owns one engine (its KV pool and prefix cache live across calls); one batch at a time."""

    def __init__(self, llm, config: EngineConfig | None = None):  # llm: kvgen.LLM
        cache = llm.generator.cache_config  # the pool stores K/V as the LLM's cache config says
        config = config or EngineConfig(max_context=llm.generator.max_context, block_size=cache.block_size,
                                        kv_budget_mb=cache.budget_mb)  # fmt: skip
        self.engine = LLMEngine(llm, config, cache)
        self._lock = threading.Lock()  # the engine is driven by one thread

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """One result per prompt, in order. `params` is one SamplingParams for all or one per prompt.

        Every prompt is validated before any runs: a bad one raises ValueError and nothing is queued.
        """
        if not prompts:
            raise ValueError("generate_batch needs at least one prompt")
        per_prompt = _params_per_prompt(params, len(prompts))
        with self._lock:
            batch = next(_batch_ids)
            requests = [
                self.engine.make_request(f"batch{batch}-{i}", prompt, p)
                for i, (prompt, p) in enumerate(zip(prompts, per_prompt))
            ]  # all validated before the first is queued
            return self._run(requests)

    def _run(self, requests: list) -> list[GenerationResult]:
        results: dict[str, GenerationResult | None] = {r.request_id: None for r in requests}
        started = time.perf_counter()
        try:
            for request in requests:
                self.engine.add(request)
            pending = set(results)
            while pending:
                for output in self.engine.step():
                    if output.request_id not in results or not output.finished:
                        continue
                    if output.error:
                        raise RuntimeError(f"request {output.request_id} failed: {output.error}")
                    results[output.request_id] = output.result
                    pending.discard(output.request_id)
        finally:  # an error (or KeyboardInterrupt) must not leave requests holding pool blocks
            for request in requests:
                self.engine.cancel(request.request_id)
        seconds = time.perf_counter() - started
        done = []
        for request in requests:
            result = results[request.request_id]
            assert result is not None
            result.timings.decode_tokens, result.timings.decode_seconds = len(result.token_ids), seconds
            done.append(result)
        return done

def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts: give one for all, or one per prompt")
    return params

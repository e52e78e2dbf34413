"""LLMEngine: requests arrive at any time; each `step()` runs one batched forward for all of them.

    engine = LLMEngine(llm, EngineConfig(kv_budget_mb=64))
    engine.add_request("a", prompt_ids, SamplingParams(max_new_tokens=16))
    while engine.has_unfinished():
        for output in engine.step(): ...

Not thread-safe: one thread drives it (engine/async_engine.py does, for the server).
"""

from __future__ import annotations

from typing import Sequence

from kvgen.engine.config import EngineConfig
from kvgen.engine.request import Request, RequestOutput, RequestStatus
from kvgen.engine.runner import ModelRunner
from kvgen.engine.scheduler import Scheduler
from kvgen.generate import Generator
from kvgen.kv.block_pool import BlockPool
from kvgen.kv.interface import CacheSpec
from kvgen.kv.paged import PagedStorage
from kvgen.sampling.output import stop_token_ids
from kvgen.sampling.params import SamplingParams


class LLMEngine:
    # SamplingParams fields the engine honours; the server rejects the others with a clear 400.
    supported_params = frozenset({
        "max_new_tokens", "min_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop_token_ids", "stop", "ignore_eos",
        "logprobs", "top_logprobs", "structured",
    })  # fmt: skip

    def __init__(self, llm, config: EngineConfig | None = None):  # llm: kvgen.LLM
        self.config = config or EngineConfig()
        self.model, self.tokenizer = llm.model, llm.tokenizer
        model_context = self.model.config.max_position_embeddings
        self.max_context = min(self.config.max_context or model_context, model_context)
        spec = CacheSpec.for_model(self.model.config, self.model.dtype)
        if self.config.num_blocks is not None:
            self.storage = PagedStorage(spec, BlockPool(self.config.num_blocks, self.config.block_size))
        else:
            self.storage = PagedStorage.create(spec, self.config.kv_budget_mb, self.config.block_size)
        self.scheduler = Scheduler(self.storage, self.config)
        self.runner = ModelRunner(self.model)
        self.requests: dict[str, Request] = {}
        self._prompts = Generator(self.model, self.tokenizer, self.max_context)  # the same prompt checks as one-shot generation

    def make_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
        priority: int = 0, salt: str = "",
    ) -> Request:  # fmt: skip
        """A validated request, not yet queued (safe to call from any thread: it touches no state).
        Raises ValueError saying what to change when the request cannot run."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"the engine runs one sample per request, got n={params.n}: submit n requests (seeds seed + i)")
        if params.context_shift:
            raise ValueError("context_shift is not supported by the batching engine: leave it off")
        ids = self._prompts.encode_prompt(prompt)  # empty, out-of-vocabulary or too-long prompts raise
        longest = min(len(ids) + params.max_new_tokens, self.max_context)
        pool = self.storage.pool
        if pool.blocks_for(longest) > pool.num_blocks:
            raise ValueError(
                f"prompt + max_new_tokens ({longest} tokens) needs more KV blocks than the whole pool has "
                f"({pool.num_blocks} blocks of {pool.block_size}): lower max_new_tokens or raise the KV budget"
            )
        stop_ids = stop_token_ids(params, self.tokenizer)
        vocab = self.model.config.vocab_size
        return Request(request_id, ids, params, self.tokenizer, stop_ids, self.max_context, vocab, priority, salt)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use: pick a unique id")
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def add_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
        priority: int = 0, salt: str = "",
    ) -> Request:  # fmt: skip
        request = self.make_request(request_id, prompt, params, priority, salt)
        self.add(request)
        return request

    def cancel(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free everything it holds; None if it is unknown or already done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.release(request)
        return request.abort("cancelled")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        rows = self.scheduler.schedule()
        if not rows:
            return []
        try:
            tokens = self.runner.run(rows)
        except Exception as error:  # noqa: BLE001 - a failed forward fails its requests, never the engine
            return [self._fail(row.request, f"{type(error).__name__}: {error}") for row in rows]
        outputs = []
        for row, token in zip(rows, tokens):
            request = row.request
            if token is None:
                continue
            if not request.prompt_indexed:  # the prompt is computed: let concurrent requests share it
                self.scheduler.index_blocks(request)
                request.prompt_indexed = True
            output = request.append(token)
            if output.finished:
                self.scheduler.index_blocks(request)
                self.scheduler.release(request)
                del self.requests[request.request_id]
            outputs.append(output)
        return outputs

    def _fail(self, request: Request, message: str) -> RequestOutput:
        self.scheduler.release(request)
        self.requests.pop(request.request_id, None)
        return request.abort("error", message)

    def generate(self, prompts: list[str | Sequence[int]], params: SamplingParams | None = None) -> list[Request]:
        """Run prompts to completion together; the finished requests (output_ids, finish_reason), in order."""
        requests = [self.add_request(f"generate-{id(self)}-{i}", p, params) for i, p in enumerate(prompts)]
        while any(r.status is not RequestStatus.FINISHED for r in requests):
            self.step()
        return requests

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
        for request in self.requests.values():
            assert request.status is not RequestStatus.FINISHED, f"finished request {request.request_id} still tracked"

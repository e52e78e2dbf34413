"""LLMEngine: requests arrive at any time; each `step()` runs one batched forward for all of them.

    engine = LLMEngine(llm, EngineConfig(kv_budget_mb=64))
    engine.add_request("a", prompt_ids, SamplingParams(max_new_tokens=16))
    while engine.has_unfinished():
        for output in engine.step(): ...

Not thread-safe: one thread drives it (engine/async_engine.py does, for the server).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from kvgen.engine.config import EngineConfig
from kvgen.engine.request import Request, RequestOutput, RequestStatus
from kvgen.engine.runner import ModelRunner
from kvgen.engine.scheduler import Scheduler
from kvgen.engine.speculation import RequestSpeculation, check_engine_config
from kvgen.engine.state_backend import state_backend
from kvgen.cache_factory import CacheFactory
from kvgen.config import CacheConfig
from kvgen.kv.disk_store import DiskBlockStore, model_fingerprint
from kvgen.kv.disk_tier import PrefixDiskTier
from kvgen.kv.ssm import SSMStateCache
from kvgen.lora.adapter import UnknownAdapterError
from kvgen.models.recurrent import RecurrentLM
from kvgen.prompt_checks import check_params, encode_prompt
from kvgen.sampling.params import SamplingParams
from kvgen.sampling.request_state import RequestState
from kvgen.speculative.adaptive import SpeculativeStats
from kvgen.speculative.config import SpeculativeConfig


# Staging slots of a quantized pool beyond one per running request: a prompt chunk that crosses a
# block boundary holds two for the length of a step (kv/paged_codes.py).
STAGING_SPARE = 4


class LLMEngine:
    # SamplingParams fields the engine honours; the server rejects the others with a clear 400.
    supported_params = frozenset({
        "max_new_tokens", "min_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop_token_ids", "stop", "ignore_eos",
        "logprobs", "top_logprobs", "structured", "adapter", "skip_special_tokens", "include_stop_str_in_output",
    })  # fmt: skip

    def __init__(self, llm, config: EngineConfig | None = None, cache: CacheConfig | None = None):  # llm: kvgen.LLM
        """`cache` says how the pool stores K/V (fp32 blocks, or quantized with its K and V dtypes);
        default: the LLM's own cache config. The pool's size comes from `config`. A cache kind or
        option the pool cannot honour is a ValueError here, before anything runs."""
        self.config = config or EngineConfig()
        self.model, self.tokenizer = llm.model, llm.tokenizer
        if self.model.device.type != "cpu":
            raise ValueError(f"the engine runs on the CPU; this model is on {self.model.device} (kvgen's GPU path "
                             "runs LLM.generate / stream / sessions): load it with device='cpu' to serve it")  # fmt: skip
        model_context = self.model.config.max_position_embeddings
        self.max_context = min(self.config.max_context or model_context, model_context)
        self.cache_config = cache or llm.generator.cache_config
        # Mamba and T5 keep their own per-request state: whole reservations instead of pool blocks.
        self.state_model = hasattr(self.model, "new_state_cache")
        self.caches = CacheFactory(self.cache_config, self.model, self.tokenizer, self.max_context)  # also one-off caches (prompt logprobs)
        if self.state_model:
            self.storage, self.scheduler = state_backend(self.model, self.config, self.cache_config)
        else:
            # The disk tier stores one block per prefix node: it keeps every layer in one block.
            self.storage = self.caches.block_storage(self.config.block_size, self.config.max_num_seqs + STAGING_SPARE,
                                                 self.config.kv_budget_mb, self.config.num_blocks,
                                                 layer_groups=self.config.layer_groups and self.config.kv_cache_dir is None)  # fmt: skip
            self.scheduler = Scheduler(self.storage, self.config, lambda: self.caches.engine_cache(self.storage))
        self.disk = self._open_disk_tier(llm) if self.config.kv_cache_dir is not None else None
        self.scheduler.disk = self.disk
        self.runner = ModelRunner(self.model)
        self.adapters = getattr(llm, "adapters", None)  # AdapterRegistry: the LoRA adapters requests may name
        self.requests: dict[str, Request] = {}
        self.speculative_totals = SpeculativeStats()  # over every speculative request (metrics)

    def _open_disk_tier(self, llm) -> PrefixDiskTier:
        """The prefix index's disk tier in config.kv_cache_dir (locked for this engine; ValueError
        when the directory is unusable or another engine holds it)."""
        assert self.scheduler.prefix is not None  # EngineConfig requires the prefix cache
        path = getattr(llm, "path", None)
        if path is None:
            raise ValueError("kv_cache_dir needs the model's file to fingerprint its blocks: load the model with kvgen.LLM.load")
        directory = Path(self.config.kv_cache_dir)
        store = DiskBlockStore(directory, int(self.config.kv_disk_budget_mb * 2**20))
        try:
            store.load({
                "model": model_fingerprint(path, directory), "weights": str(llm.weights),
                "format": self.storage.format_key, "block_size": str(self.storage.block_size),
            })  # fmt: skip
        except BaseException:
            store.close()
            raise
        return PrefixDiskTier(self.scheduler.prefix, self.storage, store)

    def close(self) -> None:
        """Write the prefix index's blocks to the disk tier (if any) and release its directory, so
        the next engine on it starts warm. The engine is not used after this."""
        if self.disk is not None:
            self.disk.close()
            self.disk = self.scheduler.disk = None

    def make_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
        priority: int = 0, salt: str = "", speculative: SpeculativeConfig | None = None,
    ) -> Request:  # fmt: skip
        """A validated request, not yet queued (safe to call from any thread: it touches no state).
        Raises ValueError saying what to change when the request cannot run. `speculative` opts
        this request in to speculative decoding (engine/speculation.py)."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"the engine runs one sample per request, got n={params.n}: submit n requests (seeds seed + i)")
        if params.context_shift:
            raise ValueError("context_shift is not supported by the batching engine: leave it off")
        vocab = self.model.config.vocab_size
        ids = encode_prompt(self.tokenizer, prompt, vocab, self.max_context)  # empty, out-of-vocabulary or too-long prompts raise
        check_params(params, vocab)
        if params.adapter is not None:  # UnknownAdapterError unless loaded; its blocks are keyed apart
            salt = f"{salt}\x00{self._adapter_key(params.adapter, speculative)}"
        longest = min(len(ids) + params.max_new_tokens, self.max_context)
        if self.state_model:
            if speculative is not None and not isinstance(self.model, RecurrentLM):  # T5: its encoder cache keeps no positions
                raise ValueError(f"speculative decoding is not supported for {self.model.config.architecture} models: leave it off")
            if speculative is not None:  # a verify keeps the state after each draft: lookup or a KV-cache draft model
                speculative.check_target(self.model)
            self.scheduler.check_fits(len(ids), longest - len(ids))
        elif (needed := self._most_blocks(longest)) > (pool := self.storage.pool).num_blocks:
            raise ValueError(
                f"prompt + max_new_tokens ({longest} tokens) needs up to {needed} KV blocks at once, more KV blocks than the "
                f"whole pool has ({pool.num_blocks} blocks of {pool.block_size}): lower max_new_tokens or raise "
                f"the KV budget"
            )
        # Built on the caller's thread: a grammar that cannot be enforced fails before queueing.
        state = RequestState(params, self.tokenizer, ids, vocab, self.max_context)
        request = Request(request_id, ids, params, state, priority, salt)
        if speculative is not None:  # built last: nothing to free when an earlier check fails
            check_engine_config(speculative)
            proposer = speculative.build_proposer(self)  # needs model, tokenizer, max_context, cache_config
            request.speculation = RequestSpeculation(speculative, proposer, request.sampler, self.speculative_totals)
        return request

    def _most_blocks(self, num_tokens: int) -> int:
        """The most pool blocks a request of `num_tokens` positions holds at once (LayerGroups.most_blocks;
        a step's tokens, drafts included, stay within max_tokens_per_step): one that cannot fit an
        empty pool would wait forever."""
        return self.storage.groups.most_blocks(num_tokens, self.config.max_tokens_per_step, self.storage.pool.block_size)

    def _adapter_key(self, name: str, speculative: SpeculativeConfig | None) -> str:
        if self.adapters is None:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded: this model serves no adapters")
        if speculative is not None:
            speculative.check_adapter(name)  # under an adapter: lookup or a draft model
        return self.adapters.cache_key(name)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use: pick a unique id")
        if request.params.adapter is not None:  # held until the request ends (an unload waits for it)
            self.adapters.acquire(request.params.adapter)
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def _release_adapter(self, request: Request) -> None:
        if request.params.adapter is not None:
            self.adapters.release(request.params.adapter, len(request.prompt_ids), len(request.output_ids))

    def add_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
        priority: int = 0, salt: str = "", speculative: SpeculativeConfig | None = None,
    ) -> Request:  # fmt: skip
        request = self.make_request(request_id, prompt, params, priority, salt, speculative)
        self.add(request)
        return request

    def cancel(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free everything it holds; None if it is unknown or already done."""
        return self._end(request_id, "cancelled")

    def fail(self, request_id: str, error: str) -> RequestOutput | None:
        """End a request with finish_reason "error" and free everything it holds."""
        return self._end(request_id, "error", error)

    def _end(self, request_id: str, reason: str, error: str | None = None) -> RequestOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.release(request)
        request.release_speculation()
        self._release_adapter(request)
        return request.abort(reason, error)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        self._draft()
        rows = self.scheduler.schedule()
        if not rows:
            return []
        try:
            new_tokens = self.runner.run(rows)
        except Exception as error:  # noqa: BLE001 - a failed forward fails its requests, never the engine
            failed = [self.fail(row.request.request_id, f"{type(error).__name__}: {error}") for row in rows]
            return [output for output in failed if output is not None]
        # A step of one row took its request's draft and forward only: its draft-length controller
        # weighs that time against its plain steps', as the single-sequence decoder's does.
        seconds = time.perf_counter() - started if len(rows) == 1 else None
        for row in rows:
            if row.request.speculation is not None:
                row.request.speculation.settle(seconds)
        outputs = []
        for row, tokens in zip(rows, new_tokens):
            request = row.request
            if not tokens:
                continue
            if not request.prompt_indexed:  # the prompt is computed: let concurrent requests share it
                self.scheduler.index_blocks(request)
                request.prompt_indexed = True
            output = request.append(tokens)
            if output.finished:
                # A speculative run may have gone past the finishing token: the cache keeps exactly
                # the ids before the last, as after plain decoding, so the index matches its blocks.
                cut_to_ids(request.cache, min(request.cache.seq_len, len(request.all_ids) - 1))
                self.scheduler.index_blocks(request)
                self.scheduler.release(request)
                request.release_speculation()
                self._release_adapter(request)
                del self.requests[request.request_id]
            outputs.append(output)
        return outputs

    def _draft(self) -> None:
        """Each speculative request that is decoding drafts for this step, within its token budget
        and the context (the scheduler may still trim the draft); one whose drafts cost work of their
        own only while at most `speculative_max_batch` requests decode (EngineConfig)."""
        decoding: int | None = None  # counted once, and only where a costly proposer asks
        for request in self.scheduler.running:
            if request.speculation is None or not request.is_decoding:
                continue
            if not request.speculation.proposer.drafts_for_free:
                if decoding is None:
                    decoding = sum(r.is_decoding for r in self.scheduler.running)
                if decoding > self.config.speculative_max_batch:
                    request.speculation.discard()  # decodes plainly; an EAGLE head still takes its features
                    continue
            tokens_left = request.state.budget - len(request.output_ids)
            positions_left = self.max_context - request.num_computed - 1
            request.speculation.propose(request.all_ids, min(tokens_left - 1, positions_left))

    def generate(
        self, prompts: list[str | Sequence[int]], params: SamplingParams | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> list[Request]:  # fmt: skip
        """Run prompts to completion together; the finished requests (output_ids, finish_reason), in order."""
        requests = [self.add_request(f"generate-{id(self)}-{i}", p, params, speculative=speculative)
                    for i, p in enumerate(prompts)]  # fmt: skip
        while any(r.status is not RequestStatus.FINISHED for r in requests):
            self.step()
        return requests

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
        for request in self.requests.values():
            assert request.status is not RequestStatus.FINISHED, f"finished request {request.request_id} still tracked"


def cut_to_ids(cache: object, length: int) -> None:
    """Cut a finished request's cache back to `length` tokens (the ids before its last), so the
    prefix index matches what it holds. A state cache whose verify went past the finishing token
    holds no state there: it goes back to its latest checkpoint at or before it instead (dropping
    the later ones), as the state is released right after."""
    if isinstance(cache, SSMStateCache):
        length = cache.resume_point(length)
    cache.truncate(length)  # type: ignore[attr-defined]

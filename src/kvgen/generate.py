"""Generator: prefill + decode over the cache contract, as a stream of text chunks.

The loop does constant Python work per token: one forward of one token (the cache appends in place),
one sample, one incremental detokenizer step. Nothing in it grows with the sequence length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch

from kvgen.cache_factory import CacheFactory
from kvgen.config import CacheConfig
from kvgen.kv.interface import KVCache
from kvgen.loading.tokenizer import Tokenizer
from kvgen.lora.adapter import UnknownAdapterError
from kvgen.models.base import DecoderLM
from kvgen.prompt_checks import check_params, encode_prompt
from kvgen.result import GenerationResult, Timings, Usage
from kvgen.sampling.params import SamplingParams
from kvgen.sampling.request_state import RequestState
from kvgen.sampling.sampler import TokenLogprob

GREEDY_BURST = 16  # greedy tokens a GPU decodes per host round trip (a stop inside a run truncates the cache)

if TYPE_CHECKING:
    from kvgen.speculative.config import SpeculativeConfig


@dataclass(frozen=True)
class Chunk:
    text: str  # new text that is now final (may be "" while a character or a possible stop string is held back)
    token_id: int
    logprob: TokenLogprob | None = None


ChunkCallback = Callable[[Chunk], None]


class Generator:
    """Runs requests one at a time on one model."""

    def __init__(
        self, model: DecoderLM, tokenizer: Tokenizer, max_context: int | None = None, cache: CacheConfig | None = None
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.max_context = min(max_context or model.config.max_position_embeddings, model.config.max_position_embeddings)
        self.cache_config = cache or CacheConfig()
        self.adapters = None  # the LLM's AdapterRegistry: LoRA adapters that SamplingParams.adapter may name

    @property
    def cache_config(self) -> CacheConfig:
        return self.caches.config

    @cache_config.setter
    def cache_config(self, config: CacheConfig) -> None:
        """Later requests get caches of this config (requests already running keep theirs)."""
        self.caches = CacheFactory(config, self.model, self.tokenizer, self.max_context)

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, self.model.config.vocab_size, self.max_context)

    def new_cache(self, num_tokens: int) -> KVCache:
        """An empty cache of the configured kind, with room for `num_tokens` (more can come later)."""
        return self.caches.new_cache(num_tokens)

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against this model's vocabulary, and
        that the adapter it names is loaded (UnknownAdapterError)."""
        check_params(params, self.model.config.vocab_size)
        if params.adapter is not None:
            if self.adapters is None:
                raise UnknownAdapterError(f"adapter {params.adapter!r} is not loaded: this model serves no adapters")
            self.adapters.check(params.adapter)

    def generate(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, on_chunk: ChunkCallback | None = None,
        speculative: "SpeculativeConfig | None" = None,
    ) -> GenerationResult:
        """One completion. `on_chunk` is called with every chunk as it is produced; an exception it
        raises stops generation, frees the request's cache and propagates."""
        if params is not None and params.n > 1:
            raise ValueError(f"params.n is {params.n}: call generate_n() for several samples of one prompt")
        stream = self.stream(prompt, params, on_chunk, speculative)
        for _ in stream:
            pass
        return stream.result

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, on_chunk: ChunkCallback | None = None,
        speculative: "SpeculativeConfig | None" = None,
    ) -> "GenerationStream":
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt)
        self.check_params(params)
        cache = self.new_cache(len(ids) + params.max_new_tokens)
        return GenerationStream(self, cache, ids, reused=0, params=params, owns_cache=True, on_chunk=on_chunk,
                                speculative=speculative)  # fmt: skip

    def generate_n(self, prompt: str | Sequence[int], params: SamplingParams) -> list[GenerationResult]:
        """params.n samples of one prompt. The prompt is prefilled once; each sample forks that cache
        (copy-on-write for the paged cache) and samples with seed + i when a seed is given."""
        ids = self.encode_prompt(prompt)
        self.check_params(params)
        base = self.new_cache(len(ids) + params.max_new_tokens)
        try:
            started = time.perf_counter()
            with torch.inference_mode():
                logits = self.model(torch.tensor([ids]), base, adapter=params.adapter)[0, -1]  # [V]
            prefill_seconds = time.perf_counter() - started
            results = []
            for i in range(params.n):
                stream = GenerationStream(
                    self, base.fork(), ids, len(ids), params, owns_cache=True, first_logits=logits.clone(), seed_offset=i
                )
                if i == 0:  # the prefill is counted once, on the first sample
                    stream.result.usage.cached_tokens = 0
                    stream.result.timings.prefill_tokens, stream.result.timings.prefill_seconds = len(ids), prefill_seconds
                for _ in stream:
                    pass
                results.append(stream.result)
            return results
        finally:
            base.release()


class GenerationStream:
    """Iterate for `Chunk`s; afterwards `.result` holds text, ids, finish reason, usage and timings.

    `cache` must hold the KV of `prompt_ids[:reused]` already; the rest of the prompt is prefilled
    (or, with `first_logits`, the whole prompt is in the cache and these are its last logits).
    When the stream ends, the cache holds the prompt and every generated token but the last.
    """

    def __init__(
        self, generator: Generator, cache: KVCache, prompt_ids: list[int], reused: int, params: SamplingParams,
        owns_cache: bool = False, on_chunk: ChunkCallback | None = None, first_logits: torch.Tensor | None = None,
        seed_offset: int = 0, speculative: "SpeculativeConfig | None" = None,
    ):  # fmt: skip
        self.generator = generator
        self.owns_cache = owns_cache  # a one-shot request: free the cache when the stream ends
        self.cache = cache
        self.prompt_ids = prompt_ids
        self.reused = reused
        self.params = params
        self.on_chunk = on_chunk
        self.first_logits = first_logits
        self.shifted = 0  # positions dropped by context shifts
        # Built now, so a grammar the tokenizer cannot serve fails before any work (and frees nothing).
        self.state = RequestState(params, generator.tokenizer, prompt_ids, generator.model.config.vocab_size,
                                  generator.max_context, seed_offset=seed_offset, cached_tokens=reused)  # fmt: skip
        self.sampler = self.state.sampler
        self.result = self.state.result()  # live: token ids and timings fill in as the stream runs
        self.speculative = speculative
        if speculative is not None and generator.model.device.type != "cpu":
            raise ValueError(f"speculative decoding runs on the CPU; this model is on {generator.model.device}, where "
                             "greedy decoding already runs many steps per host round trip: generate without speculative")
        if speculative is not None:
            speculative.check_target(generator.model)  # a state model: lookup or a KV-cache draft model only
            speculative.check_adapter(params.adapter)  # under an adapter: lookup or a draft model
        # Built now so a bad speculative setup fails before any work; it drafts after the prefill.
        if speculative is not None:
            # raises where the request cannot have the alternatives asked for
            speculative.alternatives_for(params, generator.model, cache)
        self._proposer = speculative.build_proposer(generator) if speculative is not None else None
        self._speculator = None  # SpeculativeDecoder, built after the prefill
        self._iterator = self._run()

    def __iter__(self) -> Iterator[Chunk]:
        return self._iterator

    def __next__(self) -> Chunk:
        return next(self._iterator)

    def close(self) -> None:
        """Cancel: stop generating and free the request's cache (when the stream owns it)."""
        self._iterator.close()

    def ids_in_cache(self) -> list[int]:
        """The token ids whose keys and values the cache holds now (valid at any point of the stream;
        after a context shift the cache no longer matches any token prefix, so nothing is reusable)."""
        if self.shifted or self.cache.positions_removed:  # context shift, or a sink cache's evictions
            return []
        return (self.prompt_ids + self.result.token_ids)[: self.cache.seq_len]

    def _shift_context(self) -> None:
        """Keep the first context_keep positions, drop the older half of the rest (llama.cpp's
        context shift); the kept keys are re-rotated to their new positions. A cache that can only
        drop whole pooled chunks widens the range to them (removable_range)."""
        keep = min(self.params.context_keep, self.cache.seq_len - 2)
        start, end = self.cache.removable_range(keep, keep + (self.cache.seq_len - keep) // 2)
        self.cache.remove_range(start, end, self.generator.model.rerotate)
        self.shifted += end - start

    def _run(self) -> Iterator[Chunk]:
        adapters, adapter = self.generator.adapters, self.params.adapter
        if adapter is not None:  # held while generating: an unload waits for this request
            adapters.acquire(adapter)  # type: ignore[union-attr]
        try:
            for chunk in self._generate():
                if self.on_chunk is not None:
                    self.on_chunk(chunk)  # an exception here ends the request: the finally frees its cache
                yield chunk
        finally:  # also on an exception or when the consumer abandons the stream
            if self._proposer is not None:
                self._proposer.release()
            if self.owns_cache:
                self.cache.release()
            if adapter is not None:
                adapters.release(adapter, len(self.prompt_ids), len(self.result.token_ids))  # type: ignore[union-attr]

    def _prefill(self) -> torch.Tensor:
        """The logits [V] that choose the first new token."""
        if self.first_logits is not None:
            return self.first_logits
        self.cache.truncate(self.reused)
        pending = self.prompt_ids[self.reused :]
        self.result.timings.prefill_tokens = len(pending)
        return self.generator.model(torch.tensor([pending]), self.cache, adapter=self.params.adapter)[0, -1]  # [V]

    def _greedy_burst(self, token: int, remaining: int) -> list[int] | None:
        """On a GPU, plain greedy tokens decode GREEDY_BURST at a time from CUDA graph replays with no
        host round trip between them (models/cuda_graphs.py); they are emitted one by one like a
        verified speculative run, so stops still end the text where they occur. None: one at a time."""
        model = self.generator.model
        if model.device.type != "cuda" or not self.sampler.plain_greedy or self.params.adapter or self.shifted:
            return None
        steps = min(GREEDY_BURST, remaining)
        if steps < 2 or self.cache.seq_len + steps >= self.generator.max_context:
            return None
        return model.greedy_steps(token, self.cache, steps)

    @torch.inference_mode()
    def _generate(self) -> Iterator[Chunk]:
        model, result, params, sampler, state = self.generator.model, self.result, self.params, self.sampler, self.state
        max_context = self.generator.max_context

        started = time.perf_counter()
        token = sampler(self._prefill())
        result.timings.prefill_seconds = time.perf_counter() - started
        ahead: list[int] = []  # tokens a speculative step produced that are not emitted yet
        if self.speculative is not None:
            from kvgen.speculative.decoder import SpeculativeDecoder  # lazy: speculative imports session

            self._speculator = SpeculativeDecoder(model, self.cache, self._proposer, sampler, self.speculative, max_context,
                                                  params.adapter)  # fmt: skip
            self._speculator.start(self.prompt_ids + [token])
            result.speculative = self._speculator.stats

        decode_started = time.perf_counter()
        while True:
            delta = state.append([token], more_follow=bool(ahead))
            if not state.stopped_on_token:
                yield Chunk(delta.text, token, delta.logprobs[-1] if delta.logprobs else None)
            elif delta.text:  # a stop id has no text, but it releases what was held back
                yield Chunk(delta.text, token)
            if delta.finished:
                break
            if ahead:
                token = ahead.pop(0)
            elif self._speculator is not None and not self.shifted and self.cache.seq_len + 1 < max_context:
                ahead = self._speculator.step(state.budget - len(result.token_ids))
                token = ahead.pop(0)
            elif burst := self._greedy_burst(token, state.budget - len(result.token_ids)):
                ahead = burst
                token = ahead.pop(0)
            else:
                if params.context_shift and self.cache.seq_len + 1 > max_context:
                    self._shift_context()
                token = sampler(model(torch.tensor([[token]]), self.cache, adapter=params.adapter)[0, -1])
            result.timings.decode_tokens += 1
        if ahead:  # stopped inside a verified run: the cache must hold the emitted tokens but the last
            self.cache.truncate(len(self.prompt_ids) + len(result.token_ids) - 1)
        state.result()
        result.timings.decode_seconds = time.perf_counter() - decode_started

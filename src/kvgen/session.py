"""Session: a conversation that keeps its KV cache between turns.

Each turn's prompt is compared with the tokens already in the cache; only the part after the longest
common prefix is prefilled. That holds for chat templates that re-render the whole conversation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

from kvgen.generate import Chunk, GenerationResult, GenerationStream, Generator
from kvgen.sampling.params import SamplingParams

if TYPE_CHECKING:
    from kvgen.speculative.config import SpeculativeConfig

INITIAL_CAPACITY = 1024  # positions; the cache doubles when a conversation grows past it


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Session:
    def __init__(self, generator: Generator, system_prompt: str | None = None):
        self.generator = generator
        self.cache = generator.new_cache(INITIAL_CAPACITY)
        self.messages: list[dict[str, str]] = []
        if system_prompt:
            self.messages.append({"role": "system", "content": system_prompt})
        self._last: GenerationStream | None = None
        self.last_result: GenerationResult | None = None

    @property
    def cached_ids(self) -> list[int]:
        return self._last.ids_in_cache() if self._last is not None else []

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, speculative: "SpeculativeConfig | None" = None
    ) -> GenerationStream:
        """Continue from the cache: `prompt` is the whole conversation so far, as text or ids."""
        ids = self.generator.encode_prompt(prompt)
        # Keep at least one prompt token to prefill: its logits choose the first new token.
        reused = min(common_prefix_length(self.cached_ids, ids), len(ids) - 1)  # the stream truncates to it
        self._last = GenerationStream(self.generator, self.cache, ids, reused, params or SamplingParams(), speculative=speculative)
        return self._last

    def chat(
        self, user_message: str, params: SamplingParams | None = None, speculative: "SpeculativeConfig | None" = None
    ) -> Iterator[Chunk]:
        """Add a user turn, stream the assistant's answer, and record it in `messages` when done."""
        messages = self.messages + [{"role": "user", "content": user_message}]
        prompt = self.generator.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        stream = self.stream(self.generator.tokenizer.encode(prompt, add_special_tokens=False), params, speculative)
        yield from stream
        self.messages = messages + [{"role": "assistant", "content": stream.result.text}]
        self.last_result = stream.result

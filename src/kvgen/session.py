"""Session: a conversation that keeps its KV cache between turns.

Each turn's prompt is compared with the tokens already in the cache; only the part after the longest
common prefix is prefilled. That holds for chat templates that re-render the whole conversation.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from kvgen.generate import Chunk, ChunkCallback, GenerationResult, GenerationStream, Generator
from kvgen.replies import (REPLY_FORMATS, ParsedReply, ReplyFormat, detect_reply_format, parse_reply, reply_parser,
                           skips_special_tokens)  # fmt: skip
from kvgen.token_ids import common_prefix_length
from kvgen.sampling.params import SamplingParams

if TYPE_CHECKING:
    from kvgen.speculative.config import SpeculativeConfig

INITIAL_CAPACITY = 1024  # positions; the cache doubles when a conversation grows past it


class Session:
    """A conversation (or any growing prompt) whose KV cache is kept between turns.

    Not shared between threads: give each thread its own Session (they may share one LLM; the model
    serializes forwards). `fork()` branches the conversation (copy-on-write with the paged cache);
    `rewind()` drops tokens or turns from the end.
    """

    def __init__(self, generator: Generator, system_prompt: str | None = None, reply_format: str = "auto"):
        if reply_format not in REPLY_FORMATS:
            raise ValueError(f"reply_format must be one of {', '.join(REPLY_FORMATS)}, got {reply_format!r}")
        self.generator = generator
        # How chat replies split into reasoning and content (chat() records the content as the turn).
        self.reply_format: ReplyFormat = detect_reply_format(generator.tokenizer) if reply_format == "auto" else reply_format  # type: ignore[assignment]
        self.last_reply: ParsedReply | None = None
        self.cache = generator.new_cache(INITIAL_CAPACITY)
        self.messages: list[dict[str, Any]] = []
        if system_prompt:
            self.messages.append({"role": "system", "content": system_prompt})
        self._last: GenerationStream | None = None
        self._ids: list[int] = []  # the cached ids when no stream is attached (after fork / rewind)
        self.last_result: GenerationResult | None = None
        self._adapter: str | None = None  # the LoRA adapter the cached keys and values were computed with

    @property
    def cached_ids(self) -> list[int]:
        """Token ids whose KV the cache holds now."""
        ids = self._last.ids_in_cache() if self._last is not None else self._ids
        return ids[: self.cache.seq_len]

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, on_chunk: ChunkCallback | None = None,
        speculative: "SpeculativeConfig | None" = None,
    ) -> GenerationStream:
        """Continue from the cache: `prompt` is the whole conversation so far, as text or ids."""
        params = params or SamplingParams()
        if params.n > 1:
            raise ValueError("a Session continues one conversation: use n=1, or fork() the session per sample")
        ids = self.generator.encode_prompt(prompt)
        self.generator.check_params(params)
        # Keep at least one prompt token to prefill: its logits choose the first new token.
        reused = min(common_prefix_length(self.cached_ids, ids), len(ids) - 1)  # the stream truncates to it
        if hasattr(self.cache, "resume_point"):  # a recurrent state rewinds only to its checkpoints
            reused = self.cache.resume_point(reused)
        if params.adapter != self._adapter:  # another adapter's keys and values are not this turn's
            reused = 0
        self._last = GenerationStream(self.generator, self.cache, ids, reused, params, on_chunk=on_chunk, speculative=speculative)
        self._adapter = params.adapter
        return self._last

    def chat(
        self, user_message: str, params: SamplingParams | None = None, speculative: "SpeculativeConfig | None" = None
    ) -> Iterator[Chunk]:
        """Add a user turn, stream the assistant's answer, and record it in `messages` when done:
        its content, and its reasoning as `reasoning_content` (and `thinking`, gpt-oss's name) for
        the chat template to show again or drop. `last_reply` holds the parsed reply. The chunks are
        the raw text; for a harmony model (gpt-oss) it keeps the channels' special tokens."""
        params = params or SamplingParams()
        if not skips_special_tokens(self.reply_format) and params.skip_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        messages = self.messages + [{"role": "user", "content": user_message}]
        prompt = self.generator.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        stream = self.stream(self.generator.tokenizer.encode(prompt, add_special_tokens=False), params, speculative=speculative)
        yield from stream
        reply = parse_reply(reply_parser(self.reply_format, prompt), stream.result.text)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.reasoning is not None:
            message["reasoning_content"] = message["thinking"] = reply.reasoning
        self.messages = messages + [message]
        self.last_result, self.last_reply = stream.result, reply

    def fork(self) -> "Session":
        """An independent copy that shares the cached prefix (copy-on-write where the cache allows)."""
        twin = Session.__new__(Session)
        twin.generator, twin.cache = self.generator, self.cache.fork()
        twin.messages = [dict(m) for m in self.messages]
        twin.reply_format, twin.last_reply = self.reply_format, self.last_reply
        twin._last, twin._ids, twin.last_result = None, self.cached_ids, self.last_result
        twin._adapter = self._adapter
        return twin

    def rewind(self, *, num_tokens: int | None = None, num_turns: int | None = None) -> None:
        """Forget the last `num_tokens` cached tokens, or the last `num_turns` user/assistant exchanges
        (the cache then keeps only what the shorter conversation shares with it)."""
        if (num_tokens is None) == (num_turns is None):
            raise ValueError("rewind: give exactly one of num_tokens or num_turns")
        ids = self.cached_ids
        if num_tokens is not None:
            if not 0 <= num_tokens <= len(ids):
                raise ValueError(f"rewind: num_tokens must be in [0, {len(ids)}] (the cached tokens), got {num_tokens}")
            keep = len(ids) - num_tokens
        else:
            assert num_turns is not None
            starts = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
            if not 0 <= num_turns <= len(starts):
                raise ValueError(f"rewind: num_turns must be in [0, {len(starts)}] (the user turns so far), got {num_turns}")
            if num_turns:
                self.messages = self.messages[: starts[len(starts) - num_turns]]
            remaining = self._encode(self.messages, add_generation_prompt=False) if self.messages else []
            keep = common_prefix_length(ids, remaining)
        if hasattr(self.cache, "resume_point"):  # a recurrent state rewinds only to its checkpoints
            keep = self.cache.resume_point(keep)
        self.cache.truncate(keep)
        self._last, self._ids = None, ids[:keep]

    def close(self) -> None:
        """Give the cache back (pool blocks for the paged cache)."""
        self.cache.release()
        self._last, self._ids = None, []

    def _encode(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        prompt = self.generator.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.generator.tokenizer.encode(prompt, add_special_tokens=False)

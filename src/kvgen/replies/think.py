"""Replies that reason inside `<think>` ... `</think>` before answering (Qwen3, DeepSeek-R1,
SmolLM3, QwQ). The block opens the reply, or the chat template's generation prompt opened it already
(`starts_in_reasoning`: DeepSeek-R1, Qwen3's thinking releases), so the reply begins inside it. A
reply that never closes it (cut off by max_tokens) is reasoning to its end; the whitespace between
the block and the answer belongs to neither."""

from __future__ import annotations

from kvgen.replies.parts import Part, held_tail

OPEN, CLOSE = "<think>", "</think>"


class ThinkParser:
    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self._state = "reasoning" if starts_in_reasoning else "start"
        self._buffer = ""

    def feed(self, text: str, final: bool = False) -> list[Part]:
        self._buffer += text
        parts: list[Part] = []
        while True:
            if self._state == "start":
                stripped = self._buffer.lstrip()
                if stripped.startswith(OPEN):
                    self._buffer, self._state = stripped[len(OPEN) :], "reasoning"
                elif OPEN.startswith(stripped) and not final:
                    return parts  # still may open the block
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                end = self._buffer.find(CLOSE)
                if end < 0:
                    keep = 0 if final else held_tail(self._buffer, (CLOSE,))
                    _emit(parts, "reasoning", self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return parts
                _emit(parts, "reasoning", self._buffer[:end])
                self._buffer, self._state = self._buffer[end + len(CLOSE) :], "after"
            elif self._state == "after":
                stripped = self._buffer.lstrip()
                if not stripped:
                    self._buffer = ""
                    return parts
                self._buffer, self._state = stripped, "content"
            else:
                _emit(parts, "content", self._buffer)
                self._buffer = ""
                return parts


def _emit(parts: list[Part], kind: str, text: str) -> None:
    if text:
        parts.append(Part(kind, text))  # type: ignore[arg-type]

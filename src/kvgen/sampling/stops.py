"""Incremental stop strings: text is released as soon as it cannot be the start of a stop string.

Feed the text of each token as it arrives. Text before a match is released; a tail that could still
grow into a stop string is held back (and never released if it does); the stop string itself is
released only where asked (`keep_stop`: vLLM's include_stop_str_in_output). Works on decoded text, so a stop split across tokens, or across the bytes of one
multi-byte character (the detokenizer only hands over whole characters), is found all the same.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopCheck:
    text: str  # now safe to emit
    stop: str | None  # the stop string that matched (generation ends), or None


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...], keep_stop: bool = False):
        self.stops, self.keep_stop = stops, keep_stop
        self._held = ""  # a tail that is a prefix of some stop string
        self._longest = max((len(s) for s in stops), default=0)

    def feed(self, text: str) -> StopCheck:
        if not self.stops:
            return StopCheck(text, None)
        buffer = self._held + text
        match = self._earliest_match(buffer)
        if match is not None:
            index, stop = match
            self._held = ""
            return StopCheck(buffer[: index + (len(stop) if self.keep_stop else 0)], stop)
        keep = self._partial_suffix_length(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return StopCheck(buffer[: len(buffer) - keep], None)

    def flush(self) -> str:
        """Generation ended for another reason: the held-back text was not a stop after all."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, buffer: str) -> tuple[int, str] | None:
        found = [(buffer.find(s), s) for s in self.stops]
        hits = [(i, s) for i, s in found if i >= 0]
        return min(hits, key=lambda hit: hit[0]) if hits else None

    def _partial_suffix_length(self, buffer: str) -> int:
        """Length of the longest tail of `buffer` that is a proper prefix of a stop string."""
        for length in range(min(len(buffer), self._longest - 1), 0, -1):
            tail = buffer[-length:]
            if any(s.startswith(tail) for s in self.stops):
                return length
        return 0

"""From sampled tokens to final text and the decision to stop: one per request.

Shared by the one-request loop (generate.py) and the engine (engine/request.py), so both stop on
the same rules: a stop token id or EOS, a stop string (held back while it may still match, never
emitted), a grammar that is complete, and the token budget.
"""

from __future__ import annotations

from typing import Protocol

from kvgen.loading.tokenizer import Tokenizer
from kvgen.sampling.params import SamplingParams
from kvgen.sampling.stops import StopStringMatcher


class _Finishable(Protocol):
    def is_finished(self) -> bool: ...


def stop_token_ids(params: SamplingParams, tokenizer: Tokenizer) -> frozenset[int]:
    """The ids that end a request when sampled: the stop ids asked for, and EOS unless ignored."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(tokenizer.eos_token_ids)
    return frozenset(ids)


class OutputTracker:
    """Feed every sampled token to `add`; once `finish_reason` is set, call `flush` for the text
    still held back. `stopped_on_token` says the last token was a stop id (it has no text)."""

    def __init__(
        self, params: SamplingParams, tokenizer: Tokenizer, stop_ids: frozenset[int], budget: int,
        constraint: _Finishable | None = None,
    ):  # fmt: skip
        self.params, self.stop_ids, self.budget, self.constraint = params, stop_ids, budget, constraint
        self.detokenizer = tokenizer.detokenizer(params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.num_tokens = 0
        self.finish_reason: str | None = None  # "stop" or "length"
        self.stop_reason: str | int | None = None  # the stop string or stop token id that matched
        self.stopped_on_token = False

    def add(self, token: int, more_follow: bool = False) -> str:
        """The text that `token` makes final ("" while it is held back, or for a stop id).

        more_follow: tokens after this one were already chosen (a verified speculative run), so the
        grammar's state is past them and says nothing about this token; a run always ends at the
        token that completes the grammar, so only its last token needs the check."""
        self.num_tokens += 1
        if token in self.stop_ids:
            self.stopped_on_token = True
            self._finish("stop", token if token in self.params.stop_token_ids else None)
            return ""
        check = self.stops.feed(self.detokenizer.add(token))
        if check.stop is not None:
            self._finish("stop", check.stop)
        elif not more_follow and self.constraint is not None and self.constraint.is_finished():
            self._finish("stop")  # the grammar is complete: nothing more may follow
        elif self.num_tokens >= self.budget:
            self._finish("length")
        return check.text

    def flush(self) -> str:
        """At the end: the text still held by the detokenizer and the stop matcher. A stop string
        that matched drops it; an incomplete character may still complete a stop string."""
        if isinstance(self.stop_reason, str):
            return ""
        tail = self.stops.feed(self.detokenizer.flush())
        if tail.stop is not None:
            self._finish("stop", tail.stop)
            return tail.text
        return tail.text + self.stops.flush()

    def _finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason

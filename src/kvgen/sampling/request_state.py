"""One request's sampling state, the same wherever it runs (`Generator`, the engine, `generate_batch`,
the server): its sampler (penalties, seed, logprobs), grammar constraint, output tracker (detokenizer,
stop ids and strings, token budget) and usage.

    state = RequestState(params, tokenizer, prompt_ids, vocab_size, max_context)
    token = state.sampler(logits)          # the caller runs the model and samples
    delta = state.append([token])          # new final text, tokens, logprobs; finish_reason once done
    ...
    result = state.result()                # GenerationResult: the deltas' text joined, usage, logprobs

Building one compiles the grammar, so a constraint the tokenizer cannot serve fails before any work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgen.loading.tokenizer import Tokenizer
from kvgen.result import GenerationResult, Usage
from kvgen.sampling.grammar import GrammarConstraint
from kvgen.sampling.output import OutputTracker, stop_token_ids
from kvgen.sampling.params import SamplingParams
from kvgen.sampling.sampler import Sampler, TokenLogprob


@dataclass(frozen=True)
class Delta:
    """What one `append` added: the tokens kept (none after the one that finishes), the text that is
    now final (on the finishing append, also the text held back until then) and their logprobs."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of token_ids, when params.logprobs
    finish_reason: str | None = None  # set on the last delta: "stop" or "length"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestState:
    def __init__(
        self, params: SamplingParams, tokenizer: Tokenizer, prompt_ids: list[int], vocab_size: int, max_context: int,
        seed_offset: int = 0, cached_tokens: int = 0,
    ):  # fmt: skip
        self.params = params
        self.stop_ids = stop_token_ids(params, tokenizer)
        constraint = GrammarConstraint.create(params.structured, tokenizer) if params.structured else None
        self.sampler = Sampler(
            params, prompt_ids=prompt_ids, vocab_size=vocab_size, stop_ids=sorted(self.stop_ids),
            constraint=constraint, seed_offset=seed_offset,
        )  # fmt: skip
        # A context shift frees room as it goes, so only max_new_tokens bounds the output.
        self.budget = params.max_new_tokens if params.context_shift else min(params.max_new_tokens, max_context - len(prompt_ids))
        self.output = OutputTracker(params, tokenizer, self.stop_ids, self.budget, constraint)
        # One live result: token_ids and usage grow as tokens are appended; result() completes it.
        self._result = GenerationResult(usage=Usage(prompt_tokens=len(prompt_ids), cached_tokens=cached_tokens))
        self._pieces: list[str] = []  # joined once, in result(): no per-token string copies

    @property
    def token_ids(self) -> list[int]:
        """Every token appended and kept so far (the live list)."""
        return self._result.token_ids

    @property
    def usage(self) -> Usage:
        return self._result.usage

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason

    @property
    def stopped_on_token(self) -> bool:
        """The last token was a stop id or EOS (it has no text)."""
        return self.output.stopped_on_token

    def append(self, tokens: list[int], more_follow: bool = False) -> Delta:
        """Record sampled tokens (one, or a verified speculative run; the sampler already advanced its
        penalties and grammar past them). Tokens after the one that finishes are dropped.
        more_follow: tokens of the same run come in a later call (the grammar is already past them)."""
        if self.output.finish_reason is not None:
            raise ValueError(f"the request already finished ({self.output.finish_reason}): nothing more can be appended")
        first = len(self.token_ids)
        pieces: list[str] = []
        for i, token in enumerate(tokens):
            self.token_ids.append(token)
            pieces.append(self.output.add(token, more_follow=more_follow or i < len(tokens) - 1))
            if self.output.finish_reason is not None:
                pieces.append(self.output.flush())  # the request ends: release what the stop matcher held back
                break
        text = "".join(pieces)
        self._pieces.append(text)
        self.usage.completion_tokens = len(self.token_ids)
        logprobs = self.sampler.logprobs[first : len(self.token_ids)] if self.params.logprobs else []
        return Delta(self.token_ids[first:], text, logprobs, self.output.finish_reason)

    def result(self) -> GenerationResult:
        """The request so far (whole once finished): text, ids, finish and stop reason, usage, logprobs.
        The same object every call, brought up to date."""
        result = self._result
        result.text = "".join(self._pieces)
        self._pieces = [result.text]
        result.finish_reason, result.stop_reason = self.output.finish_reason, self.output.stop_reason
        result.usage.completion_tokens = len(result.token_ids)
        if self.params.logprobs:
            result.logprobs = self.sampler.logprobs[: len(result.token_ids)]
        return result

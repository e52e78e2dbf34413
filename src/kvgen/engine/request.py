"""One request's state inside the engine: its tokens, its cache, how it is sampled and stopped."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from kvgen.engine.speculation import RequestSpeculation
from kvgen.generate import Usage
from kvgen.kv.paged import PagedCache
from kvgen.kv.prefix import PrefixNode
from kvgen.loading.tokenizer import Tokenizer
from kvgen.sampling.grammar import GrammarConstraint
from kvgen.sampling.params import SamplingParams
from kvgen.sampling.sampler import Sampler, TokenLogprob
from kvgen.sampling.output import OutputTracker

_arrivals = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not started, or preempted (its cache was freed; it will recompute)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What one step produced for one request: the new token (if any), the new final text, and,
    on the last output, why it finished."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error"
    usage: Usage | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of `token_ids`, when asked for


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tokenizer: Tokenizer
    stop_ids: frozenset[int]
    max_context: int
    vocab_size: int
    priority: int = 0  # lower runs first; FCFS among equals
    salt: str = ""  # requests with different salts never share cached KV
    arrival: int = field(default_factory=lambda: next(_arrivals))
    arrival_time: float = field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    cache: PagedCache | None = None
    prefix_node: PrefixNode | None = None  # the locked end of this request's indexed path
    prompt_indexed: bool = False
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache on first admission
    miss_reason: str | None = None  # why the prefix cache did not serve (part of) the prompt
    num_preemptions: int = 0
    finish_reason: str | None = None
    first_token_time: float | None = None
    speculation: RequestSpeculation | None = None  # set by the engine when the request opts in

    def __post_init__(self) -> None:
        # Built here, on the caller's thread: a grammar that cannot be enforced fails before queueing.
        p = self.params
        constraint = GrammarConstraint.create(p.structured, self.tokenizer) if p.structured else None
        self.sampler = Sampler(p, prompt_ids=self.prompt_ids, vocab_size=self.vocab_size, stop_ids=sorted(self.stop_ids),
                               constraint=constraint)  # fmt: skip
        budget = min(p.max_new_tokens, self.max_context - len(self.prompt_ids))
        self.output = OutputTracker(p, self.tokenizer, self.stop_ids, budget, constraint)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_computed(self) -> int:
        return self.cache.seq_len if self.cache is not None else 0

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token is left to run (a decode step; it may carry drafts)."""
        return self.num_pending == 1 and bool(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens to run before the next sample: the rest of the prompt (after a preemption: of
        prompt + outputs), or the last sampled token."""
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed

    @property
    def sort_key(self) -> tuple[int, int]:
        return self.priority, self.arrival

    def usage(self) -> Usage:
        return Usage(len(self.prompt_ids), len(self.output_ids), self.cached_tokens)

    def append(self, tokens: list[int]) -> RequestOutput:
        """Record sampled tokens (one, or a verified speculative run; the sampler already advanced
        its penalties / grammar past them); finish the request when a stop condition holds, as
        GenerationStream does for one request. Tokens after the one that finishes are dropped."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        kept: list[int] = []
        pieces: list[str] = []
        for i, token in enumerate(tokens):
            self.output_ids.append(token)
            kept.append(token)
            pieces.append(self.output.add(token, more_follow=i < len(tokens) - 1))
            if self.output.finish_reason is not None:
                break
        first = len(self.output_ids) - len(kept)
        logprobs = self.sampler.logprobs[first : len(self.output_ids)] if self.params.logprobs else []
        if self.output.finish_reason is None:
            return RequestOutput(self.request_id, kept, "".join(pieces), logprobs=logprobs)
        pieces.append(self.output.flush())  # the request ends: release what the stop matcher held back
        self.status, self.finish_reason = RequestStatus.FINISHED, self.output.finish_reason
        return RequestOutput(self.request_id, kept, "".join(pieces), True, self.finish_reason, self.usage(), logprobs=logprobs)

    def release_speculation(self) -> None:
        if self.speculation is not None:
            self.speculation.release()

    def abort(self, reason: str, error: str | None = None) -> RequestOutput:
        self.status, self.finish_reason = RequestStatus.FINISHED, reason
        return RequestOutput(self.request_id, [], "", True, reason, self.usage(), error)

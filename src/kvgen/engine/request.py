"""One request's state inside the engine: its tokens, its cache, how it is sampled and stopped."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from dataclasses import dataclass, field

from kvgen.engine.speculation import RequestSpeculation
from kvgen.kv.paged import PagedCache
from kvgen.kv.prefix import PrefixNode
from kvgen.result import GenerationResult, Usage
from kvgen.sampling.output import OutputTracker
from kvgen.sampling.params import SamplingParams
from kvgen.sampling.request_state import RequestState
from kvgen.sampling.sampler import Sampler, TokenLogprob

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
    result: GenerationResult | None = None  # on the last output: the whole request (text, ids, usage, logprobs)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    state: RequestState  # sampler, grammar, output tracker, budget, logprobs, usage
    priority: int = 0  # lower runs first; FCFS among equals
    salt: str = ""  # requests with different salts never share cached KV
    arrival: int = field(default_factory=lambda: next(_arrivals))
    arrival_time: float = field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.WAITING
    cache: PagedCache | None = None
    prefix_node: PrefixNode | None = None  # the locked end of this request's indexed path
    prompt_indexed: bool = False
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache on first admission
    miss_reason: str | None = None  # why the prefix cache did not serve (part of) the prompt
    num_preemptions: int = 0
    finish_reason: str | None = None
    first_token_time: float | None = None
    speculation: RequestSpeculation | None = None  # set by the engine when the request opts in

    @property
    def sampler(self) -> Sampler:
        return self.state.sampler

    @property
    def output(self) -> OutputTracker:
        return self.state.output

    @property
    def output_ids(self) -> list[int]:
        return self.state.token_ids

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
        its penalties / grammar past them); finish the request when a stop condition holds.
        Tokens after the one that finishes are dropped."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.state.usage.cached_tokens = self.cached_tokens  # set by the scheduler on admission
        delta = self.state.append(tokens)
        if not delta.finished:
            return RequestOutput(self.request_id, delta.token_ids, delta.text, logprobs=delta.logprobs)
        self.status, self.finish_reason = RequestStatus.FINISHED, delta.finish_reason
        result = self.state.result()
        result.speculative = self.speculation.stats if self.speculation is not None else None
        return RequestOutput(self.request_id, delta.token_ids, delta.text, True, self.finish_reason, result.usage,
                             logprobs=delta.logprobs, result=result)  # fmt: skip

    def release_speculation(self) -> None:
        if self.speculation is not None:
            self.speculation.release()

    def abort(self, reason: str, error: str | None = None) -> RequestOutput:
        """End the request early ("cancelled" or "error"); its result holds what was final so far."""
        self.status, self.finish_reason = RequestStatus.FINISHED, reason
        self.state.usage.cached_tokens = self.cached_tokens
        result = dataclasses.replace(self.state.result(), finish_reason=reason, stop_reason=None, error=error,
                                     speculative=self.speculation.stats if self.speculation is not None else None)  # fmt: skip
        return RequestOutput(self.request_id, [], "", True, reason, result.usage, error, result=result)

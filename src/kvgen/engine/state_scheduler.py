"""StateScheduler: the engine's scheduler for models whose per-request memory is not paged K/V blocks.

A Mamba request holds one fixed-size recurrent state whatever its length; a T5 request holds a
reference to its input's cross-attention K/V (shared by requests with the same input) and a decoder
K/V cache that grows to at most prompt-independent `max_new_tokens + 1` positions. So instead of
reserving blocks step by step, a request reserves its whole need in *units* when it is admitted
(`StateBudget`: one state for Mamba; one position of every decoder layer's K and V for T5, counted
for its encoder input and its longest output) and keeps it until it ends. Nothing grows past its
reservation, so nobody is ever preempted; a request that does not fit waits. (A speculative
verify keeps a state after each of its drafts for the length of its step: its truncate frees them.)

Mamba's prefix cache (kv/state_prefix.py) keeps state snapshots at block boundaries, one unit each,
in whatever the running requests leave of the budget; before each step the snapshots the last step
captured are handed to it. A hybrid's (Granite 4.0-H) also keeps the keys and values of each block
on the path to a snapshot, counted in positions as a request's reservation is. T5's sharing is the
model's EncoderCache (one entry per distinct input). A T5 prompt is the encoder's input and runs
whole, in the step that admits it (past what is left of the step's token budget if it is longer,
which ends the budget: at most one such prompt a step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvgen.engine.config import EngineConfig
from kvgen.engine.request import Request, RequestStatus
from kvgen.engine.scheduler import ScheduledRow
from kvgen.kv.hybrid import HybridStateCache
from kvgen.kv.ssm import SSMStateCache
from kvgen.kv.state_prefix import StatePrefixIndex


@dataclass(frozen=True)
class StatePool:
    num_blocks: int  # units in the budget (what the engine's metrics read as the pool's size)


@dataclass(frozen=True)
class StateBudget:
    """The engine's memory for a state model, in units of `unit_bytes` (metrics read it as its storage)."""

    format_key: str
    unit_bytes: int
    num_units: int
    block_size: int  # tokens between the prefix cache's snapshots
    units_for: Callable[[int, int], int]  # (prompt tokens, most new tokens) -> units a request reserves

    @property
    def pool(self) -> StatePool:
        return StatePool(self.num_units)

    def bytes_per_block(self) -> int:
        return self.unit_bytes


class StateScheduler:
    def __init__(self, budget: StateBudget, config: EngineConfig, new_cache: Callable[[Request], object], whole_prompt: bool,
                 prefix: StatePrefixIndex | None):  # fmt: skip
        self.budget, self.config, self.new_cache = budget, config, new_cache
        self.whole_prompt = whole_prompt  # True: a prompt runs in one forward (T5's encoder input)
        self.prefix = prefix
        self.waiting: list[Request] = []  # kept sorted by (priority, arrival)
        self.running: list[Request] = []
        self.num_preemptions = 0  # reservations are whole: never preempts
        self.disk = None  # no disk tier for states
        self._units: dict[Request, int] = {}  # running request -> units it reserved

    def check_fits(self, num_prompt: int, num_new: int) -> None:
        """ValueError when a request of this size could never be admitted."""
        need = self.budget.units_for(num_prompt, num_new)
        if need > self.budget.num_units:
            raise ValueError(
                f"prompt + max_new_tokens ({num_prompt} + {num_new} tokens) needs {need * self.budget.unit_bytes / 2**20:.1f} MB "
                f"of state, more than the engine's whole budget ({self.budget.num_units * self.budget.unit_bytes / 2**20:.1f} MB): "
                "lower max_new_tokens or raise the KV budget"
            )

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.waiting.sort(key=lambda r: r.sort_key)

    def _units_in_use(self) -> int:
        return sum(self._units.values()) + (self.prefix.num_units if self.prefix is not None else 0)

    def schedule(self) -> list[ScheduledRow]:
        for request in self.running:  # the last step's block-boundary snapshots go to the prefix cache
            self.index_blocks(request)
        budget, rows = self.config.max_tokens_per_step, []
        self.running.sort(key=lambda r: r.sort_key)
        for request in self.running:
            if budget == 0:
                break
            count = min(request.num_pending, budget)
            count += self._fit_draft(request, budget - count)
            rows.append(ScheduledRow(request, count))
            budget -= count
        while budget > 0 and self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self._admit(request):
                break  # try again when a running request has finished
            # After admission: a prefix hit left fewer tokens to compute.
            # A whole prompt may go past what is left of the budget, which it then ends: one per step.
            count = request.num_pending if self.whole_prompt else min(request.num_pending, budget)
            rows.append(ScheduledRow(request, count))
            budget -= min(count, budget)
        return rows

    @staticmethod
    def _fit_draft(request: Request, spare_budget: int) -> int:
        """How many of a decoding request's drafts run with its last token this step: as many as
        the spare budget allows (the rest dropped). The states a verify keeps after each draft are
        the request's own for the step: its truncate frees them."""
        speculation = request.speculation
        if speculation is None or not speculation.draft:
            return 0
        extra = min(len(speculation.draft), spare_budget) if request.is_decoding else 0
        speculation.trim(extra)
        return extra

    def _admit(self, request: Request) -> bool:
        """Reserve the request's units (evicting prefix snapshots if needed) and give it a cache,
        resumed from the deepest snapshot of its prompt's path."""
        need = self.budget.units_for(len(request.prompt_ids), request.output.budget)
        short = self._units_in_use() + need - self.budget.num_units
        if short > 0 and self.prefix is not None:
            self.prefix.shrink(short)
            short = self._units_in_use() + need - self.budget.num_units
        if short > 0:
            return False
        cache = self.new_cache(request)
        if self.prefix is not None:
            assert isinstance(cache, SSMStateCache)
            # The last known token is always recomputed: its logits give the next token.
            match = self.prefix.match(request.all_ids, request.salt, max_tokens=len(request.all_ids) - 1)
            if match.snapshot is not None and isinstance(cache, HybridStateCache):
                cache.restore(match.num_tokens, match.snapshot, match.kv_blocks)
            elif match.snapshot is not None:
                cache.restore(match.num_tokens, match.snapshot)
            if request.miss_reason is None:
                request.cached_tokens, request.miss_reason = match.num_tokens, match.reason
        elif request.miss_reason is None:
            request.miss_reason = "disabled"
        request.cache = cache  # type: ignore[assignment]
        self._units[request] = need
        self.waiting.pop(0)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._fit_prefix()
        return True

    def _fit_prefix(self) -> None:
        """The prefix cache may hold what the running requests leave of the budget."""
        if self.prefix is not None:
            self.prefix.max_units = max(self.budget.num_units - sum(self._units.values()), 0)
            self.prefix.shrink(self.prefix.num_units - self.prefix.max_units)

    def index_blocks(self, request: Request) -> None:
        """Hand the request's block-boundary snapshots to the prefix cache (dropped without one),
        so its own memory stays one live state."""
        cache = request.cache
        if not isinstance(cache, SSMStateCache):
            return
        taken = cache.take_checkpoints()
        if self.prefix is not None and taken:
            kv_block = cache.kv_block if isinstance(cache, HybridStateCache) else None
            self.prefix.insert(request.all_ids, taken, request.salt, kv_block)

    def release(self, request: Request) -> None:
        """Drop the request from the running or waiting set and free everything it holds."""
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self._units.pop(request, None)
        if request.cache is not None:
            request.cache.release()
        request.cache = None
        self._fit_prefix()

    def num_blocks_in_use(self) -> int:
        return self._units_in_use()

    def check_invariants(self) -> None:
        assert self._units_in_use() <= self.budget.num_units, "state budget exceeded"
        assert set(self._units) == set(self.running), "reservations do not match the running requests"
        for request in self.running:
            assert request.cache is not None, f"running request {request.request_id} has no cache"
            if isinstance(request.cache, SSMStateCache):
                request.cache.check_invariants()
        for request in self.waiting:
            assert request.cache is None, f"waiting request {request.request_id} still holds a cache"
        if self.prefix is not None:
            self.prefix.check_invariants()

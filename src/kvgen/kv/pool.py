"""The pool-level KV contract: one store shared by many requests (DESIGN.md's second level).

A scheduler (continuous batching) talks to a `KVPool`; the model talks to each request's per-sequence
`KVCache` (`pool.cache(request_id)`), which writes into the pool's storage. Typical step:

    table = pool.allocate(request_id, len(prompt))   # None: out of capacity, nothing changed -> wait/preempt
    model(prompt_ids, pool.cache(request_id))         # prefill writes into the reserved blocks
    if pool.extend(request_id, 1) is None: ...        # room for the next token, or preempt someone
    tables = pool.block_tables([r1, r2, r3])          # padded [B, max_blocks] + lengths, for batched attention
    pool.free(request_id)                             # finished, cancelled or failed: every block back

Out of capacity is a normal return value (None), never an exception; a caller mistake (an unknown
request id, a negative count) is a ValueError and changes nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from kvgen.kv.interface import KVCache

RequestId = Hashable
PAD_BLOCK = -1  # block-table padding: never a real block id, so a read past `lengths` fails loudly


@dataclass(frozen=True)
class BlockTables:
    """Block tables of a batch: row b holds request b's block ids, padded with PAD_BLOCK.
    Position p of request b lives in block tables[b, p // block_size] at offset p % block_size."""

    tables: torch.Tensor  # int64 [B, max_blocks]
    lengths: torch.Tensor  # int64 [B]: committed positions of each request
    block_size: int


class KVPool(ABC):
    """Storage shared by many requests, accounted in blocks of `block_size` positions."""

    block_size: int

    @abstractmethod
    def allocate(self, request_id: RequestId, num_tokens: int) -> list[int] | None:
        """Start a request with room for `num_tokens` positions: its block table, or None (and no
        change) when the pool cannot hold it. An id already in use is a ValueError."""

    @abstractmethod
    def extend(self, request_id: RequestId, num_new_tokens: int) -> list[int] | None:
        """Room for `num_new_tokens` positions after the request's committed ones (shared blocks in
        that range are copied now, so the forward pass cannot run out): its block table, or None
        (and no change) when the pool is short."""

    @abstractmethod
    def fork(self, source_id: RequestId, request_id: RequestId) -> None:
        """A new request holding the same positions as `source_id`, sharing its blocks."""

    @abstractmethod
    def truncate(self, request_id: RequestId, num_tokens: int) -> None:
        """Keep the request's first `num_tokens` positions; whole blocks past them go back."""

    @abstractmethod
    def free(self, request_id: RequestId) -> None:
        """Give every block of the request back. Freeing a request twice is a no-op; an id the pool
        never allocated is a ValueError."""

    @abstractmethod
    def cache(self, request_id: RequestId) -> KVCache:
        """The request's per-sequence cache, for the model's forward pass."""

    @abstractmethod
    def block_tables(self, request_ids: Sequence[RequestId]) -> BlockTables:
        """Padded block tables and lengths of these requests, in this order."""

    @property
    @abstractmethod
    def num_free_blocks(self) -> int: ...

    @abstractmethod
    def check_invariants(self) -> None:
        """Reference counts equal table entries, the free queue holds exactly the unreferenced
        blocks, no block is both free and in a table (AssertionError with what is wrong)."""

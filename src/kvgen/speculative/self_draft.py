"""Layer-skip self-draft: the target's first L blocks, then its own final norm and head.

No extra weights, and where the target's cache allows, no cache of its own. At every committed
position the draft's keys and values in layers 0..L-1 are the target's: the same blocks over the
same inputs, and kvgen computes a position's keys and values bit for bit alike in the C decode step,
the verify rows and prefill. So the draft reads them from the target's cache: it appends its own
speculative positions there (layers 0..L-1 only, one C decode step over the first L blocks per
token) and truncates them away before it returns, and the verify forward then writes every layer
at those positions. The draft never prefills the prompt and never catches up on accepted or
plainly decoded tokens.

That needs a cache where such writes and the truncate leave nothing behind: one that stores plain
fp32 keys and values in place (it offers a kernel layout: contiguous, paged). Caches that round or
drop positions on write (quantized, sliding window), and the engine (whose block pool drafts must
not take), give the draft its own L-layer contiguous cache instead (`OwnCacheDraft`), kept in step
with the committed ids: the prompt prefilled once, then catch-ups, with the C rows step over
the first L blocks.
"""

from __future__ import annotations

import torch

from kvgen.cache_factory import CacheFactory
from kvgen.config import CacheConfig
from kvgen.kv.interface import KVCache
from kvgen.kv.paged import CacheFullError
from kvgen.models.base import DecoderLM
from kvgen.sampling.grammar import TokenConstraint
from kvgen.speculative.proposer import CachedDrafter, Draft, DraftPolicy, Proposer, draft_tokens

INITIAL_CAPACITY = 256


def rewinds_exactly(cache: KVCache) -> bool:
    """Whether positions written past the committed ones and truncated away leave `cache` as it
    was: true of caches that store plain fp32 keys and values in place (they offer a kernel layout)."""
    return not cache.batch_path_only and cache.kernel_layout(cache.seq_len) is not None


class OwnCacheDraft(CachedDrafter):
    """The first L blocks over a cache of their own (for targets whose cache cannot share)."""

    def __init__(self, model: DecoderLM, num_layers: int, max_context: int):
        caches = CacheFactory(CacheConfig(), model, None, max_context, num_layers=num_layers)
        super().__init__(caches.new_cache(INITIAL_CAPACITY))  # contiguous: exact rewinds
        self.model, self.num_layers = model, num_layers

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.hidden_states(input_ids, self.cache, self.num_layers)  # [1, S, H]
        return self.model.logits_from_hidden(h[0, -1])  # [V]


class SelfDraftProposer(Proposer):
    def __init__(self, model: DecoderLM, num_layers: int, max_context: int):
        if not 1 <= num_layers < model.config.num_layers:
            raise ValueError(
                f"a self-draft uses the first L (draft_layers) of the target's {model.config.num_layers} layers: "
                f"L must be in [1, {model.config.num_layers - 1}], got {num_layers}"
            )
        self.model, self.num_layers, self.max_context = model, num_layers, max_context
        self.target: KVCache | None = None  # the target's cache, when the draft shares it
        self.own: OwnCacheDraft | None = None  # built on first use when the draft cannot share

    def attach(self, cache: KVCache) -> None:
        self.target = cache if rewinds_exactly(cache) else None

    def propose(self, ids: list[int], num_tokens: int, policy: DraftPolicy, constraint: TokenConstraint | None) -> Draft:
        if self.target is None:
            if self.own is None:
                self.own = OwnCacheDraft(self.model, self.num_layers, self.max_context)
            return self.own.propose(ids, num_tokens, policy, constraint)
        start = self.target.seq_len
        assert start == len(ids) - 1, f"the target's cache holds {start} positions, the ids need {len(ids) - 1}"
        try:
            logits = self._step(ids[-1])
            return draft_tokens(logits, num_tokens, policy, constraint, self._step) if logits is not None else Draft([])
        finally:
            self.target.truncate(start)  # the draft's positions go; the verify forward writes them anew

    def _step(self, token: int) -> torch.Tensor | None:
        """Append `token` to the target's cache through the first L blocks -> the draft's logits [V]
        (None: the cache's pool has no room for it, so the draft stops here)."""
        assert self.target is not None
        try:
            h = self.model.hidden_states(torch.tensor([[token]]), self.target, self.num_layers)  # [1, 1, H]
        except CacheFullError:
            return None
        return self.model.logits_from_hidden(h[0, -1])

    def release(self) -> None:
        if self.own is not None:
            self.own.release()
        self.target = None

"""Prompt lookup: if the last n tokens appeared before in the context, guess that what followed them
then follows them now. Free to run, and strong when the output quotes its input (summaries, edits,
code, retrieval answers).
"""

from __future__ import annotations

from kvgen.sampling.grammar import TokenConstraint
from kvgen.speculative.proposer import Draft, DraftedPath, DraftPolicy, Proposer


class PromptLookupProposer(Proposer):
    drafts_for_free = True  # a dictionary lookup: only the verify rows cost anything
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        # Per n: n-gram -> the latest index j such that ids[j-n:j] is that n-gram and ids[j] exists.
        self._index: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]
        self._ids: list[int] = []
        self._indexed = 0  # continuation positions j < _indexed are in the index

    def _sync(self, ids: list[int]) -> None:
        if ids[: len(self._ids)] != self._ids or len(ids) < len(self._ids):  # a different history: rebuild
            self._index = [{} for _ in range(self.max_ngram + 1)]
            self._indexed = 0
        self._ids = list(ids)
        for j in range(max(1, self._indexed), len(ids)):  # j < len(ids): ids[j] is the continuation
            for n in range(self.min_ngram, min(self.max_ngram, j) + 1):
                self._index[n][tuple(ids[j - n : j])] = j
        self._indexed = max(self._indexed, len(ids))

    def propose(self, ids: list[int], num_tokens: int, policy: DraftPolicy, constraint: TokenConstraint | None) -> Draft:
        self._sync(ids)
        for n in range(min(self.max_ngram, len(ids)), self.min_ngram - 1, -1):  # the longest match first
            j = self._index[n].get(tuple(ids[-n:]))
            if j is not None:
                return Draft(self._allowed_prefix(ids[j : j + num_tokens], constraint))
        return Draft([])

    @staticmethod
    def _allowed_prefix(tokens: list[int], constraint: TokenConstraint | None) -> list[int]:
        """The tokens up to the first one the constraint forbids (the constraint is left as found)."""
        if constraint is None:
            return tokens
        kept: list[int] = []
        with DraftedPath(constraint) as path:
            for token in tokens:
                if not path.allows(token):
                    break
                kept.append(token)
                if not path.advance(token):
                    break
        return kept

"""Prompt lookup: if the last n tokens appeared before in the context, guess that what followed them
then follows them now. Free to run, and strong when the output quotes its input (summaries, edits,
code, retrieval answers).

A request may also bring a prediction of its output (OpenAI's Predicted Outputs: the file being
edited, the text being revised): its tokens are a second place to look, searched first, from where
the output last followed it onwards.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

from kvgen.sampling.grammar import TokenConstraint
from kvgen.speculative.proposer import Draft, DraftedPath, DraftPolicy, Proposer
from kvgen.token_ids import common_prefix_length


class PromptLookupProposer(Proposer):
    drafts_for_free = True  # a dictionary lookup: only the verify rows cost anything
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, prediction: Sequence[int] = ()):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        # Per n: n-gram -> the latest index j such that ids[j-n:j] is that n-gram and ids[j] exists.
        self._index: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]
        self._ids: list[int] = []
        self._indexed = 0  # continuation positions j < _indexed are in the index
        self.prediction = list(prediction)
        # Per n: n-gram -> every index j (ascending) such that prediction[j-n:j] is that n-gram and
        # prediction[j] exists. A repeated n-gram (a line that occurs twice in a file) continues from
        # its first occurrence at or after the cursor: how far the output has followed the prediction.
        # Only accepted drafts move the cursor, so a chance match of a common token far ahead does
        # not lose the place.
        self._prediction_index: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_ngram + 1)]
        for j in range(1, len(self.prediction)):
            for n in range(min_ngram, min(max_ngram, j) + 1):
                self._prediction_index[n].setdefault(tuple(self.prediction[j - n : j]), []).append(j)
        self._cursor = 0
        self._drafted: tuple[int, int] | None = None  # (len(ids), j) of the last draft from the prediction

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
        self._advance_cursor(ids)
        for n in range(min(self.max_ngram, len(ids)), self.min_ngram - 1, -1):  # the longest match first
            key = tuple(ids[-n:])
            if (j := self._predicted_continuation(key)) is not None:
                self._drafted = (len(ids), j)
                return Draft(self._allowed_prefix(self.prediction[j : j + num_tokens], constraint))
            j = self._index[n].get(key)
            if j is not None:
                return Draft(self._allowed_prefix(ids[j : j + num_tokens], constraint))
        return Draft([])

    def _advance_cursor(self, ids: list[int]) -> None:
        """Past the drafted prediction tokens the output kept since the last draft from it."""
        if self._drafted is None:
            return
        length, j = self._drafted
        self._drafted = None
        kept = common_prefix_length(ids[length:], self.prediction[j:]) if len(ids) > length else 0
        if kept:
            self._cursor = j + kept

    def _predicted_continuation(self, key: tuple[int, ...]) -> int | None:
        """Where the prediction continues after n-gram `key`: its first occurrence at or after the
        cursor, else its last before it (the output went back over predicted text)."""
        positions = self._prediction_index[len(key)].get(key)
        if not positions:
            return None
        at = bisect_left(positions, self._cursor)
        return positions[at] if at < len(positions) else positions[-1]

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

"""Prompt lookup: the longest recent n-gram match, its continuation, and grammar masking."""

from __future__ import annotations

from kvgen.sampling.params import SamplingParams
from kvgen.speculative.prompt_lookup import PromptLookupProposer
from kvgen.speculative.proposer import DraftPolicy
from tests.speculative.constraints import ForbidSet

POLICY = DraftPolicy(SamplingParams())


def test_continues_the_latest_longest_match():
    lookup = PromptLookupProposer(max_ngram=3)
    ids = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # [1, 2, 3] occurred at 0 and 5; the latest earlier occurrence (5) is followed by 7, 8, 5.
    assert lookup.propose(ids, 3, POLICY, None).tokens == [7, 8, 5]
    assert lookup.propose(ids, 10, POLICY, None).tokens == [7, 8, 5, 1, 2, 3]  # up to the end of the context


def test_falls_back_to_shorter_ngrams_and_to_nothing():
    lookup = PromptLookupProposer(max_ngram=3)
    assert lookup.propose([4, 5, 6, 5], 2, POLICY, None).tokens == [6, 5]  # only the 1-gram [5] matches
    assert PromptLookupProposer().propose([1, 2, 3], 4, POLICY, None).tokens == []


def test_index_follows_a_growing_history_and_a_changed_one():
    lookup = PromptLookupProposer(max_ngram=2)
    assert lookup.propose([1, 2, 3, 1], 2, POLICY, None).tokens == [2, 3]
    assert lookup.propose([1, 2, 3, 1, 2, 4, 1, 2], 1, POLICY, None).tokens == [4]  # latest [1, 2] -> 4
    assert lookup.propose([5, 6, 5], 1, POLICY, None).tokens == [6]  # not an extension: rebuilt


def test_drafts_stop_at_the_first_token_the_constraint_forbids():
    lookup = PromptLookupProposer()
    constraint = ForbidSet({3})
    assert lookup.propose([1, 2, 5, 3, 4, 1, 2], 4, POLICY, constraint).tokens == [5]
    assert constraint.consumed == []  # left as found

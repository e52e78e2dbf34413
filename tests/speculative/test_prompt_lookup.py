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


def test_a_prediction_is_searched_before_the_context():
    # [1, 2] is followed by 3 in the context and by 8 in the prediction: the prediction wins.
    lookup = PromptLookupProposer(max_ngram=2, prediction=[1, 2, 8, 9])
    assert lookup.propose([1, 2, 3, 1, 2], 2, POLICY, None).tokens == [8, 9]
    # No match in the prediction: the context still drafts.
    assert PromptLookupProposer(prediction=[7, 7]).propose([4, 5, 6, 5], 2, POLICY, None).tokens == [6, 5]


def test_a_prediction_continues_where_the_output_last_followed_it():
    # The prediction holds the line [5, 6] twice; each occurrence is followed by something else.
    prediction = [5, 6, 1, 2, 5, 6, 3, 4]
    lookup = PromptLookupProposer(max_ngram=2, prediction=prediction)
    assert lookup.propose([0, 5, 6], 2, POLICY, None).tokens == [1, 2]  # the first occurrence
    # The output kept the draft [1, 2] and went on with [5, 6]: its second occurrence is next.
    assert lookup.propose([0, 5, 6, 1, 2, 5, 6], 2, POLICY, None).tokens == [3, 4]


def test_a_rejected_draft_does_not_move_the_prediction_cursor():
    prediction = [5, 1, 2, 6, 5, 3, 4]
    lookup = PromptLookupProposer(max_ngram=1, prediction=prediction)
    # A chance match of [6] drafts from the middle of the prediction...
    assert lookup.propose([0, 6], 2, POLICY, None).tokens == [5, 3]
    # ...and is rejected (the output went on with 9): the cursor stays at the start, so [5] continues
    # from its first occurrence, not from the one after the rejected draft's start.
    assert lookup.propose([0, 6, 9, 5], 2, POLICY, None).tokens == [1, 2]
    # Kept this time: [5] now continues from the occurrence after the kept tokens.
    assert lookup.propose([0, 6, 9, 5, 1, 2, 6, 5], 2, POLICY, None).tokens == [3, 4]

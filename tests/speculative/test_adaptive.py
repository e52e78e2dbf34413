"""The draft-length controller: grow, shrink, pause and resume, step by step."""

from __future__ import annotations

import pytest

from kvgen.speculative.adaptive import DraftLengthController, SpeculativeStats


def test_grows_on_high_acceptance_up_to_the_maximum():
    c = DraftLengthController(initial=4, min_length=1, max_length=6)
    lengths = []
    for _ in range(4):
        c.record(c.draft_length(), c.length)  # everything accepted
        lengths.append(c.length)
    assert lengths == [5, 6, 6, 6]


def test_shrinks_on_low_acceptance_then_pauses_and_resumes():
    c = DraftLengthController(initial=3, min_length=1, max_length=8, window=2, cooldown=3)
    c.record(3, 1)
    assert c.length == 2  # one less: the step accepted 1, so 1 + 1 would not shrink it
    c.record(2, 0)
    assert c.length == 1  # nothing accepted: straight to one more than that
    c.record(1, 0)  # first low step at the minimum
    assert c.draft_length() == 1
    c.record(1, 0)  # a whole window (2 steps) low at the minimum: pause
    assert [c.draft_length() for _ in range(4)] == [0, 0, 0, 1]  # 3 plain tokens, then drafting again
    assert c.rolling_acceptance == 1.0  # a fresh window after the pause


def test_pauses_double_while_drafts_keep_failing_and_halve_when_one_pays():
    c = DraftLengthController(initial=1, min_length=1, max_length=1, window=1, pay_window=1, cooldown=2, max_cooldown=8)

    def pause_after_a_failed_draft() -> int:
        c.record(c.draft_length(), 0)
        plain = 0
        while c.draft_length() == 0:
            plain += 1
        return plain

    assert [pause_after_a_failed_draft() for _ in range(5)] == [2, 4, 8, 8, 8]
    c.record(1, 1)  # a draft that pays halves the next pause: one lucky draft keeps most of the back-off
    assert pause_after_a_failed_draft() == 4
    c.record(1, 1)  # the pause had doubled to 8 again; drafts that keep paying bring it down to the shortest
    c.record(1, 1)
    assert pause_after_a_failed_draft() == 2


def test_a_rejected_long_draft_drops_to_what_was_accepted_plus_one():
    c = DraftLengthController(initial=8, min_length=1, max_length=8)
    c.record(8, 0)
    assert c.length == 1


def test_a_failed_probe_after_a_pause_pauses_again_at_once():
    c = DraftLengthController(initial=1, min_length=1, max_length=4, window=4, cooldown=2, max_cooldown=16, patience=4)
    for _ in range(4):
        c.record(1, 0)  # a whole window low at the minimum: the first pause
    assert [c.draft_length() for _ in range(3)] == [0, 0, 1]
    c.record(1, 0)  # the probe fails: no second window of failures before the next, longer pause
    assert [c.draft_length() for _ in range(5)] == [0, 0, 0, 0, 1]
    c.record(1, 1)  # the probe pays: drafting goes on, and grows
    assert c.draft_length() == 2


def test_grows_while_one_more_draft_adds_a_quarter_token():
    c = DraftLengthController(initial=1, min_length=1, max_length=8)
    for accepted in [1, 0, 1, 1, 0, 1]:  # first drafts accepted 2 in 3: one more adds 2/3 * 2/3 a step
        c.record(c.length, accepted)
    assert c.length == 2
    for accepted in [1, 0, 2, 1, 0, 1, 2, 0]:  # the second accepted 2 in 5 after the first: 2/3 * 0.4 * 0.4
        c.record(2, accepted)
    assert c.growth_gain < 0.25 and c.length == 2


def test_middle_acceptance_keeps_the_length():
    c = DraftLengthController(initial=4)
    c.record(4, 2)  # 0.5: between the thresholds
    assert c.length == 4


def test_fixed_length_when_not_adaptive():
    c = DraftLengthController(initial=4, adaptive=False)
    c.record(4, 0)
    assert c.length == 4 and c.draft_length() == 4


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="min_length <= initial <= max_length"):
        DraftLengthController(initial=9, max_length=8)


def test_stats_rates():
    stats = SpeculativeStats(verify_steps=4, proposed_tokens=16, accepted_tokens=12)
    assert stats.acceptance_rate == 0.75
    assert stats.tokens_per_verify == 4.0


def test_a_draft_that_costs_more_than_it_saves_counts_as_failed():
    c = DraftLengthController(initial=2, min_length=1, max_length=4, cooldown=4)
    c.record_plain(0.010)  # a plain step takes 10 ms
    c.record(2, 2, seconds=0.020)  # 3 tokens in 20 ms: pays
    assert c.length == 3
    c.record(3, 3, seconds=0.050)  # every draft accepted, but 4 tokens took 5 plain steps' time
    assert c.length == 2
    c.record(2, 2, seconds=0.040)
    c.record(1, 1, seconds=0.030)  # the minimum length, still too slow: the second such step pauses
    c.record(1, 1, seconds=0.030)
    assert c.draft_length() == 0


def test_a_step_that_only_breaks_even_counts_as_failed():
    c = DraftLengthController(initial=2, min_length=1, max_length=4, cooldown=4)
    c.record_plain(0.010)
    c.record(2, 2, seconds=0.0285)  # 3 tokens in 0.95 of their plain time: not worth drafting
    assert c.length == 1
    c.record(1, 1, seconds=0.0175)  # 2 tokens in 0.875 of their plain time: pays, but too narrowly to
    assert c.length == 1  # grow on one step's evidence
    c.record(1, 1, seconds=0.0175)
    c.record(1, 1, seconds=0.0175)
    c.record(1, 1, seconds=0.0175)  # four steps at one draft pay together: it grows
    assert c.length == 2
    c.record(2, 2, seconds=0.0285)  # 0.95 again: back to one
    assert c.length == 1
    at_min = DraftLengthController(initial=1, min_length=1, max_length=4, cooldown=4)
    at_min.record_plain(0.010)
    at_min.record(1, 1, seconds=0.019)  # 0.95 at the minimum length: the second such step pauses
    assert at_min.draft_length() == 1
    at_min.record(1, 1, seconds=0.019)
    assert at_min.draft_length() == 0


def test_a_timed_caller_probes_one_token_first_and_a_slow_proposer_pauses_longer():
    c = DraftLengthController(initial=4, min_length=1, max_length=8, cooldown=4, max_cooldown=64)
    c.start_with_probe()
    assert c.draft_length() == 1
    c.record_plain(0.010)
    c.record(1, 1, seconds=0.015)  # pays: back to the full length (one draft says nothing of a fifth)
    assert c.draft_length() == 4
    slow = DraftLengthController(initial=4, min_length=1, max_length=8, cooldown=4, max_cooldown=64)
    slow.start_with_probe()
    slow.record_plain(0.010)
    slow.record(1, 1, seconds=0.080)  # 2 tokens in 8 plain steps' time: 4x over, a 4 x 4 pause
    assert [slow.draft_length() for _ in range(17)] == [0] * 16 + [1]


def test_a_probe_verified_by_plain_steps_fails_cheaply_and_pauses_longer():
    c = DraftLengthController(initial=4, min_length=1, max_length=8, cooldown=4, max_cooldown=64)
    c.start_with_probe()
    assert c.probing and c.draft_length() == 1
    c.record_plain(0.010)
    c.record(1, 0, seconds=0.011, draft_seconds=0.001)  # rejected: one plain step plus a 1 ms draft
    assert c.probing and c.draft_length() == 1  # a draft at 0.1 of a plain step: a second try at once
    c.record(1, 0, seconds=0.011, draft_seconds=0.001)  # the second cheap failure in a row pauses
    assert not c.probing
    assert [c.draft_length() for _ in range(5)] == [0, 0, 0, 0, 1]  # 4 plain tokens (1.1x over: still 4)
    assert c.probing
    c.record(1, 0, seconds=0.011, draft_seconds=0.001)
    c.record(1, 0, seconds=0.011, draft_seconds=0.001)
    assert [c.draft_length() for _ in range(9)] == [0] * 8 + [1]  # twice as long


def test_a_costly_first_probe_that_fails_pauses_at_once():
    c = DraftLengthController(initial=4, min_length=1, max_length=8, cooldown=4, max_cooldown=64)
    c.start_with_probe()
    c.record_plain(0.010)
    c.record(1, 0, seconds=0.015, draft_seconds=0.005)  # a draft at half a plain step, rejected
    assert [c.draft_length() for _ in range(7)] == [0] * 6 + [1]  # paused at once (1.5x over: 6)


def paused_after_paying() -> DraftLengthController:
    """A controller whose probe passed and whose batched step paid, then paused (2x over: 8 tokens)."""
    c = DraftLengthController(initial=1, min_length=1, max_length=1, cooldown=4, max_cooldown=64)
    c.start_with_probe()
    c.record_plain(0.010)
    c.record(1, 1, seconds=0.021, draft_seconds=0.001)  # the probe passes
    c.record(1, 1, seconds=0.012)  # a batched step pays
    c.record(1, 0, seconds=0.020)
    c.record(1, 0, seconds=0.020)  # two failures, the window unpaid: a pause
    assert [c.draft_length() for _ in range(9)] == [0] * 8 + [1]
    return c


def test_a_cheap_probe_of_a_proposer_that_paid_gets_a_second_try():
    c = paused_after_paying()
    c.record(1, 0, seconds=0.011, draft_seconds=0.001)  # a draft at 0.1 of a plain step: it probes again at once
    assert c.probing and c.draft_length() == 1
    c.record(1, 1, seconds=0.021, draft_seconds=0.001)  # passes on its second try: weaker evidence,
    assert not c.probing and c.draft_length() == 1  # so it resumes at the minimum (not at the length before)
    again = paused_after_paying()
    again.record(1, 0, seconds=0.011, draft_seconds=0.001)
    assert again.draft_length() == 1
    again.record(1, 0, seconds=0.011, draft_seconds=0.001)  # the second cheap failure in a row pauses
    assert [again.draft_length() for _ in range(9)] == [0] * 8 + [1]
    costly = paused_after_paying()
    costly.record(1, 0, seconds=0.015, draft_seconds=0.005)  # a draft at half a plain step: paused at once
    assert [costly.draft_length() for _ in range(13)] == [0] * 12 + [1]  # (1.5x over: 12)


def test_a_passed_probe_is_on_probation_until_a_batched_step_pays():
    c = DraftLengthController(initial=4, min_length=1, max_length=8, cooldown=4, max_cooldown=64)
    c.start_with_probe()
    c.record_plain(0.010)
    c.record(1, 1, seconds=0.021, draft_seconds=0.001)  # accepted, and drafting cost less than it saves
    assert not c.probing and c.draft_length() == 4  # the next draft is verified batched, at full length
    c.record(4, 0, seconds=0.020)  # it fails (2x a plain step's time): down to one more than it accepted
    assert c.draft_length() == 1
    c.record(1, 0, seconds=0.014)  # 1.4 plain steps: not a cheap step (those pause on a full window)
    assert c.draft_length() == 1
    c.record(1, 0, seconds=0.014)  # the second failed step at the minimum, the window unpaid: pause
    assert [c.draft_length() for _ in range(6)] == [0] * 5 + [1]  # (1.4x over: 5)
    c.record(1, 1, seconds=0.021, draft_seconds=0.001)
    c.record(1, 1, seconds=0.012)  # a batched step pays: probation ends, the next pause is halved
    assert not c.probing and c.draft_length() == 2
    c.record(2, 0, seconds=0.015)  # a failed step shrinks the draft
    assert c.draft_length() == 1


def test_one_token_drafts_accepted_half_the_time_keep_drafting_while_the_window_pays():
    fast = DraftLengthController(initial=4, min_length=1, max_length=4, cooldown=4)
    fast.record_plain(0.010)
    fast.record(4, 1, seconds=0.040)  # a long draft that does not pay: down to 2
    fast.record(2, 0, seconds=0.020)  # and to 1; what the longer drafts cost says nothing of one-token ones
    for accepted in [0, 1, 1, 0, 0, 1, 1, 0] * 3:  # 1.5 tokens per 11 ms step: 0.73 of their plain time
        length = fast.draft_length()
        assert length >= 1  # two failed steps in a row do not pause it (it may try a second draft)
        fast.record(length, min(accepted, length), seconds=0.011)
    slow = DraftLengthController(initial=1, min_length=1, max_length=4, cooldown=4)
    slow.record_plain(0.010)
    lengths = []
    for accepted in [0, 1, 1, 0, 0, 1, 1, 0]:  # 15 ms steps: the window does not pay either
        lengths.append(slow.draft_length())
        slow.record(1, accepted, seconds=0.015)
    assert lengths == [1] * 5 + [0] * 3  # paused after the second failure in a row


def test_a_probe_whose_draft_costs_more_than_it_saves_fails_even_when_accepted():
    c = DraftLengthController(initial=4, min_length=1, max_length=8, cooldown=4, max_cooldown=64)
    c.start_with_probe()
    c.record_plain(0.010)
    c.record(1, 1, seconds=0.035, draft_seconds=0.015)  # a draft token that costs 1.5 plain steps
    assert c.draft_length() == 0  # paused


def test_a_passed_probe_restores_the_length_once_and_a_shorter_length_that_pays_stays():
    c = DraftLengthController(initial=4, min_length=1, max_length=8, cooldown=4)
    c.start_with_probe()
    c.record_plain(0.010)
    c.record(1, 1, seconds=0.021, draft_seconds=0.001)  # the probe passes: back to 4
    assert c.draft_length() == 4
    c.record(4, 1, seconds=0.030)  # too slow for 2 tokens: down to one more than it accepted
    assert c.draft_length() == 2
    c.record(2, 2, seconds=0.015)  # pays at 2 (ending probation): no second jump to 4, but one more
    assert c.draft_length() == 3 and not c.probing  # draft, as the second depth is accepted half the time


def test_a_pause_weighs_the_steps_at_the_minimum_length_over_a_long_window():
    """One-token steps accepted half the time at 1.3 plain steps' cost pay (0.87 of their tokens'
    plain time), but 8 of them hold 3 or fewer acceptances 36% of the time: judged on the last eight
    alone, such a proposer pauses by chance. The pay window (32 steps) weighs a longer record; steps
    this cheap pause only once 16 or more of them cost more than plain decoding, and a lasting fall
    still pauses."""
    c = DraftLengthController(initial=1, min_length=1, max_length=1, cooldown=4)
    c.record_plain(0.010)
    for accepted in [1, 1, 0, 1, 0, 1, 1, 0, 1, 0] * 2 + [1, 0, 0, 1, 0, 0, 1, 0]:  # 13 ms steps, 15 of 28
        assert c.draft_length() == 1  # over the 28 steps: 1.54 tokens a step, 0.85 of their plain time
        c.record(1, accepted, seconds=0.013)
    lengths = []
    for accepted in [0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0] + [0] * 12:  # the proposer stops agreeing
        lengths.append(c.draft_length())
        if lengths[-1]:
            c.record(1, accepted, seconds=0.013)
    assert 0 in lengths


def test_cheap_steps_pause_only_on_a_full_window_that_costs_more_than_plain_steps():
    c = DraftLengthController(initial=1, min_length=1, max_length=1, cooldown=4)
    c.record_plain(0.010)
    for accepted in [0, 0, 0, 1] * 16:  # right a quarter of the time at 1.2 plain steps: 0.96 of plain
        assert c.draft_length() == 1  # failure streaks never pause it
        c.record(1, accepted, seconds=0.012)
    never = DraftLengthController(initial=1, min_length=1, max_length=1, cooldown=4)
    never.record_plain(0.010)
    lengths = []
    for _ in range(20):  # never right: 1.2 plain steps a token
        lengths.append(never.draft_length())
        if lengths[-1]:
            never.record(1, 0, seconds=0.012)
    assert lengths[:16] == [1] * 16 and 0 in lengths  # a full window, then a pause


def test_one_token_drafts_start_without_a_probe():
    c = DraftLengthController(initial=1, min_length=1, max_length=1)
    c.start_with_probe()  # a failed one-token draft verified batched costs one row: no probe first
    assert not c.probing and c.draft_length() == 1
    longer = DraftLengthController(initial=4, min_length=1, max_length=8)
    longer.start_with_probe()
    assert longer.probing and longer.draft_length() == 1


def test_untimed_one_token_drafts_accepted_half_the_time_keep_drafting():
    """Without timings (the engine) the rates decide, over the steps at the draft's length: a
    one-token draft right every other step yields 1.5 tokens a verify and must not pause, even
    after longer drafts that failed."""
    c = DraftLengthController(initial=4, min_length=1, max_length=4)
    c.record(4, 0)  # a long first draft fails: down to one token
    lengths = []
    for step in range(64):
        length = c.draft_length()
        lengths.append(length)
        c.record(length, min(length, step % 2))  # the first draft accepted every other step, no further one
    assert 0 not in lengths and max(lengths) <= 2


def test_untimed_failed_probe_of_a_proposer_that_paid_gets_a_second_try():
    c = DraftLengthController(initial=1, min_length=1, max_length=1, cooldown=2, patience=2)
    c.record(1, 1)  # it has paid in this request
    for _ in range(3):
        c.record(1, 0)  # then fails until it pauses
    assert c.draft_length() == 0
    while c.draft_length() == 0:
        pass
    c.record(1, 0)  # the probe fails: one more try, no pause yet
    assert c.probing and c.draft_length() == 1
    c.record(1, 0)  # the second try fails: pause again
    assert c.draft_length() == 0


def test_draft_length_defaults_per_method():
    from kvgen.speculative.config import MAX_DRAFT_TOKENS, SpeculativeConfig

    eagle = SpeculativeConfig("eagle")  # one-token drafts, no alternatives, still adaptive (it pauses)
    assert (eagle.num_draft_tokens, eagle.max_draft_tokens, eagle.draft_alternatives, eagle.adaptive) == (1, 1, None, True)
    longer = SpeculativeConfig("eagle", num_draft_tokens=3)  # a length asked for: room to adapt
    assert (longer.num_draft_tokens, longer.max_draft_tokens) == (3, MAX_DRAFT_TOKENS)
    capped = SpeculativeConfig("eagle", max_draft_tokens=2)
    assert (capped.num_draft_tokens, capped.max_draft_tokens) == (1, 2)
    lookup = SpeculativeConfig("lookup")
    assert (lookup.num_draft_tokens, lookup.max_draft_tokens) == (4, MAX_DRAFT_TOKENS)
    assert SpeculativeConfig("lookup", max_draft_tokens=2).num_draft_tokens == 2  # the default fits the cap
    assert SpeculativeConfig("lookup", num_draft_tokens=12).max_draft_tokens == 12
    with pytest.raises(ValueError, match="min_draft_tokens <= num_draft_tokens <= max_draft_tokens"):
        SpeculativeConfig("lookup", num_draft_tokens=5, max_draft_tokens=3)

"""The prefix-aware choice (replicas/affinity.py), apart from Ray."""

from __future__ import annotations

import pytest

from kvgen.replicas.affinity import AffinityTable, rank_replicas


def test_goes_to_the_replica_holding_most_of_the_prompt() -> None:
    table = AffinityTable()
    table.report("a", [1, 2], version=1)
    table.report("b", [1, 2, 3, 4], version=1)
    assert rank_replicas((1, 2, 3, 9), {"a": 0, "b": 2}, table, imbalance=4) == ([["b"], ["a"]], "prefix")
    assert table.matched_blocks("b", (1, 2, 3, 9)) == 3
    assert table.matched_blocks("a", (3, 2)) == 0  # leading blocks only: a miss ends the match


def test_a_too_long_queue_sends_the_request_to_the_least_loaded() -> None:
    table = AffinityTable()
    table.report("a", [1, 2, 3], version=1)
    assert rank_replicas((1, 2, 3), {"a": 5, "b": 0}, table, imbalance=4) == ([["b"], ["a"]], "load")
    assert rank_replicas((1, 2, 3), {"a": 4, "b": 0}, table, imbalance=4)[1] == "prefix"


def test_new_prefixes_spread_and_stick_before_any_report() -> None:
    """Nothing matches: the replica caching least among those not too loaded; a routed request's
    blocks count at once, so the next request of its prefix follows it."""
    table = AffinityTable()
    table.report("a", [7, 8], version=1)
    ranking, why = rank_replicas((1, 2), {"a": 0, "b": 1}, table, imbalance=4)
    assert (ranking[0], why) == (["b"], "spread")
    table.routed("b", (1, 2))
    assert rank_replicas((1, 2, 5), {"a": 0, "b": 1}, table, imbalance=4) == ([["b"], ["a"]], "prefix")
    assert rank_replicas((9,), {"a": 0, "b": 6}, table, imbalance=4)[0][0] == ["a"]  # b caches less but is too loaded
    assert rank_replicas((), {"a": 3, "b": 1}, table, imbalance=4) == ([["b"], ["a"]], "load")  # no prompt


def test_routed_keys_expire_and_reports_replace_reports() -> None:
    table = AffinityTable(routed_ttl_s=10)
    table.routed("a", (1, 2), now=0.0)
    assert table.matched_blocks("a", (1, 2), now=5.0) == 2
    assert table.matched_blocks("a", (1, 2), now=11.0) == 0
    table.report("a", [1], version=1)
    table.report("a", [3], version=2)  # the index evicted block 1
    assert table.matched_blocks("a", (1,)) == 0 and table.matched_blocks("a", (3,)) == 1
    table.keep_only(["b"])
    assert table.size("a") == 0


def test_no_replica_no_ranking_and_bad_options_refused() -> None:
    assert rank_replicas((1,), {}, AffinityTable(), imbalance=1) == ([], "load")
    with pytest.raises(ValueError, match="routed_ttl_s"):
        AffinityTable(routed_ttl_s=0)

"""The group drafter proposes what a sibling wrote after the same suffix, nothing without a
match, and keeps its index bounded however long the sequences get."""

from __future__ import annotations

import pytest

from rlbus.services.policy.drafters import DrafterConfigError, GroupDrafter, RecentCompletions


def test_a_row_is_offered_the_continuation_its_sibling_took() -> None:
    d = GroupDrafter(rows=3)
    d.extend(0, [5, 6, 7, 8, 9, 2])
    d.extend(1, [5, 6])
    assert d.propose(1, 3) == [7, 8, 9]
    assert d.propose(1, 10) == [7, 8, 9, 2]  # no more than the sibling wrote
    # A row that has written nothing yet is offered a sibling's opening.
    assert d.propose(2, 2) == [5, 6]


def test_the_longest_matching_suffix_wins() -> None:
    d = GroupDrafter(rows=3)
    d.extend(0, [1, 2, 3, 4])  # after "3": 4 (1-gram match)
    d.extend(1, [9, 2, 3, 7])  # after "2 3": 7; also the most recent "3"
    d.extend(2, [1, 2, 3])
    assert d.propose(2, 1) == [4]  # "1 2 3" matches row 0 only; row 1's "3 -> 7" is shorter


def test_nothing_is_proposed_without_a_match() -> None:
    d = GroupDrafter(rows=2)
    d.extend(0, [1, 2, 3])
    d.extend(1, [4])
    assert d.propose(1, 4) == []
    assert d.propose(0, 4) == []  # its own suffix is no match for itself
    assert d.propose(0, 0) == []


def test_a_row_can_continue_its_own_earlier_repetition() -> None:
    d = GroupDrafter(rows=1)
    d.extend(0, [3, 1, 4, 3, 1])
    assert d.propose(0, 2) == [4, 3]


def test_recent_completions_of_other_prompts_are_a_fallback() -> None:
    recent = RecentCompletions(recent=4)
    recent.add([7, 7, 1, 2, 0])
    d = GroupDrafter(rows=2, recent=recent)
    d.extend(0, [4, 1, 5])
    d.extend(1, [8, 1, 2])
    assert d.propose(1, 2) == [0]  # "1 2" only occurs in the recent pool (the group has "1 -> 5")
    d.add_reference([6, 8, 1, 2, 9])  # a finished sibling beats the pool at the same length
    assert d.propose(1, 2) == [9]


def test_cost_is_bounded() -> None:
    recent = RecentCompletions(recent=3, max_ngram=4)
    for i in range(50):
        recent.add([1, 2, 3, i])
    assert len(recent._new.sequences) + len(recent._old.sequences) <= 6
    assert recent.continuation([1, 2, 3], 1) == [49]  # the most recent one
    d = GroupDrafter(rows=2, max_ngram=3)
    d.extend(0, [1, 2] * 5000)
    d.extend(1, [2])
    # Keys grow with the distinct n-grams followed by something (9 here, START included), not with the 10k tokens.
    assert len(d._index._where) == 9
    assert d.propose(1, 3) == [1, 2]  # the most recent "2" that something followed


def test_bad_settings_are_refused() -> None:
    with pytest.raises(DrafterConfigError, match="rows=0"):
        GroupDrafter(rows=0)
    with pytest.raises(DrafterConfigError, match="max_ngram=0"):
        GroupDrafter(rows=1, max_ngram=0)

"""Stats: plain counters, linked parents, and tallies (hot-path counters kept as integers)."""

from __future__ import annotations

import pytest

from freezeframe.stats import Stats


def test_a_tally_counts_in_its_stats_and_every_parent() -> None:
    model = Stats()
    wrapper = model.child()
    tally = wrapper.tally("replays")
    wrapper.inc("replays", 2)
    tally.n += 3
    assert (wrapper.replays, wrapper["replays"], wrapper.get("replays")) == (5, 5, 5)
    assert model.replays == 5
    assert wrapper.snapshot() == {"replays": 5}
    assert list(model) == ["replays"]


def test_a_retired_tally_keeps_its_count_and_leaves_the_list() -> None:
    parent = Stats()
    stats = parent.child()
    tally = stats.tally("steps")
    tally.n = 7
    stats.retire(tally)
    tally.n = 100  # no longer read
    assert (stats.steps, parent.steps) == (7, 7)
    stats.retire(tally)  # twice: nothing more
    assert (stats.steps, parent.steps) == (7, 7)


def test_a_tally_made_before_linking_is_seen_by_the_new_parent() -> None:
    stats = Stats()
    tally = stats.tally("steps")
    tally.n = 4
    parent = Stats()
    stats.link_to(parent)
    assert parent.steps == 4


def test_an_unused_tally_adds_no_counter() -> None:
    stats = Stats()
    stats.tally("steps")
    assert stats.snapshot() == {}
    assert repr(stats) == "Stats()"


def test_expect_sees_tally_increments() -> None:
    stats = Stats()
    tally = stats.tally("steps")
    with stats.expect(steps=2):
        tally.n += 2
    with pytest.raises(AssertionError, match="steps: before=2 after=3 delta=1, expected delta=2"), \
            stats.expect(steps=2):
        tally.n += 1

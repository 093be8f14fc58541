"""The draft-length schedule (``runtime/draft_schedule.py``): its flag's syntax, and the cap it
chooses from measured costs and acceptance."""
from __future__ import annotations

import pytest

from runtime.draft_schedule import Costs, DraftSchedule, choose

K = 4
# a draft whose first two drafts are usually accepted, the rest rarely: (proposed, accepted)
TRACE = [(4, 2)] * 6 + [(4, 0)] * 2 + [(4, 4)] * 2


def test_the_flag_reads_busy_drafts_pairs_or_one_number():
    schedule = DraftSchedule.parse("1:4,3:2,6:0", K)
    assert [schedule.drafts(b) for b in range(1, 9)] == [4, 4, 2, 2, 2, 0, 0, 0]
    assert str(schedule) == "1:4,3:2,6:0"
    assert DraftSchedule.parse("2", K).drafts(7) == 2


@pytest.mark.parametrize("text", ["", "x", "2:4", "1:4,1:2", "1:4,3:2,2:0", "1:5", "1:-1", "1:4:2", "1:4,"])
def test_a_bad_schedule_is_refused_in_one_line(text):
    with pytest.raises(ValueError, match=r"--draft-schedule .*expected BUSY:DRAFTS pairs .* 0 \.\. 4"):
        DraftSchedule.parse(text, K)


def test_verify_rows_that_cost_nothing_are_all_used():
    """A target bound by its weights: rows are free at every batch size, so every draft is verified."""
    flat = Costs(draft=[0.1] * 8, target_one=[1.0] * 8, target_full=[1.0] * 8)
    assert choose(flat, TRACE, K) == DraftSchedule.constant(K)


def test_drafts_are_turned_down_as_rows_become_compute():
    """Rows that cost their compute once the batch is large: the cap falls with the batch, to
    target-only steps, and where rows are dear only the drafts likely to be accepted are worth it."""
    batches = range(1, 9)
    costs = Costs(draft=[0.05 * b for b in batches],
                  target_one=[1.0 + 0.1 * b for b in batches],
                  target_full=[1.0 + 0.1 * b + 0.25 * b * K for b in batches])
    schedule = choose(costs, TRACE, K)
    caps = [schedule.drafts(b) for b in batches]
    assert caps[0] >= 2 and caps[-1] == 0
    assert caps == sorted(caps, reverse=True)
    assert max(caps) == 2   # where rows cost, only the well-accepted first two drafts are worth them

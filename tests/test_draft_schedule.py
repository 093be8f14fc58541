"""The draft-length schedule (``runtime/draft_schedule.py``): its flag's syntax, and the cap it
chooses from measured costs and acceptance."""
from __future__ import annotations

import pytest

from runtime.draft_schedule import Costs, DraftSchedule, choose

K = 4


def test_the_flag_reads_busy_drafts_pairs_or_one_number():
    schedule = DraftSchedule.parse("1:4,3:2,6:0", K)
    assert [schedule.drafts(b) for b in range(1, 9)] == [4, 4, 2, 2, 2, 0, 0, 0]
    assert str(schedule) == "1:4,3:2,6:0"
    assert DraftSchedule.parse("2", K).drafts(7) == 2


@pytest.mark.parametrize("text", ["", "x", "2:4", "1:4,1:2", "1:4,3:2,2:0", "1:5", "1:-1", "1:4:2", "1:4,"])
def test_a_bad_schedule_is_refused_in_one_line(text):
    with pytest.raises(ValueError, match=r"--draft-schedule .*expected BUSY:DRAFTS pairs .* 0 \.\. 4"):
        DraftSchedule.parse(text, K)


def test_rows_that_cost_what_they_cost_alone_keep_every_draft():
    """One sequence per call (ONNX Runtime's CPU backend): every cost grows with the batch in
    step, so the engine's k holds at every load, timing noise or not."""
    one = [0.014 * b for b in range(1, 9)]
    noisy = [1.0, 0.97, 1.02, 0.99, 1.01, 0.98, 1.0, 0.99]
    costs = Costs(target_one=one, target_full=[1.5 * t * n for t, n in zip(one, noisy)])
    assert choose(costs, K) == DraftSchedule.constant(K)


def test_drafts_are_turned_down_as_rows_become_compute():
    """A batched GPU step: one row per sequence costs about the same at any batch size, k + 1
    rows per sequence cost more and more as the batch becomes compute: the cap falls with the
    batch, down to target-only steps, and never rises again."""
    batches = range(1, 17)
    costs = Costs(target_one=[1.0 + 0.01 * b for b in batches],
                  target_full=[1.0 + 0.01 * b + 0.1 * K * b for b in batches])
    caps = [choose(costs, K).drafts(b) for b in batches]
    assert caps[0] == K and caps[-1] == 0
    assert caps == sorted(caps, reverse=True) and len(set(caps)) > 2

"""The stub's batch occupancy: the time-weighted share of its running slots in use, from the first request that
ran to the last answer (toolkit.stub.scheduler.Occupancy), on a clock the test moves."""

from __future__ import annotations

import pytest

from toolkit.stub.scheduler import Occupancy


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_nothing_ran_is_no_figure() -> None:
    occ = Occupancy(4, Clock())
    occ.change(0)
    assert occ.share() is None and occ.span() == 0.0


def test_one_request_at_a_time_is_one_slot_of_the_batch() -> None:
    clock = Clock()
    occ = Occupancy(4, clock)
    for _ in range(3):
        occ.change(1)
        clock.t += 2.0
        occ.change(0)
    assert occ.share() == pytest.approx(0.25) and occ.span() == pytest.approx(6.0)
    clock.t += 50.0  # idle after the last answer: outside the span
    assert occ.share() == pytest.approx(0.25) and occ.span() == pytest.approx(6.0)


def test_a_full_batch_then_a_draining_tail_and_an_idle_gap() -> None:
    clock = Clock()
    occ = Occupancy(4, clock)
    occ.change(4)
    clock.t += 6.0  # full: 24 slot-seconds
    occ.change(1)
    clock.t += 2.0  # one long trace alone: 2
    occ.change(0)
    clock.t += 2.0  # nothing in flight between two requests: 0, but inside the span
    occ.change(2)
    clock.t += 2.0  # 4
    occ.change(0)
    assert occ.span() == pytest.approx(12.0)
    assert occ.share() == pytest.approx(30 / 48)


def test_while_requests_run_the_span_runs_to_now() -> None:
    clock = Clock()
    occ = Occupancy(2, clock)
    occ.change(2)
    clock.t += 3.0
    assert occ.share() == pytest.approx(1.0) and occ.span() == pytest.approx(3.0)
    occ.change(1)
    clock.t += 3.0
    assert occ.share() == pytest.approx(0.75)

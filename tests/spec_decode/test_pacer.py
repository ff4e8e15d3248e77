"""``SpecPacer`` (``disable_when_slower``): speculation on or off per load level from measured
output tokens per second, with a clock the test drives."""

from __future__ import annotations

import pytest

from pagedllm.core.sched.spec import SpecPacer


class _Loop:
    """Steps through a pacer: each step at ``running`` requests takes ``seconds`` and emits
    ``tokens(speculating)`` output tokens; returns the mode each step ran in."""

    def __init__(self, pacer: SpecPacer) -> None:
        self.pacer, self.now, self.step = pacer, 0.0, 0

    def run(self, n: int, running: int, seconds: float, tokens, prefill: bool = False) -> list:
        modes = []
        for _ in range(n):
            mode = self.pacer.speculate(running)
            self.pacer.scheduled(self.step, self.now, running, mode, not prefill)
            self.now += seconds
            self.pacer.updated(self.step, self.now, tokens(mode))
            self.step += 1
            modes.append(mode)
        return modes


def test_each_load_runs_its_faster_mode_and_explores_the_other() -> None:
    pacer = SpecPacer()
    loop = _Loop(pacer)
    p = SpecPacer.PHASE
    # 32 running: steps take the same time in both modes, with drafts they emit fewer tokens
    # (as on a compute-bound machine, where verifying rejected drafts costs the step time)
    slow = {True: 24, False: 32}
    modes = loop.run(2 * p, 32, 0.05, lambda m: slow[m])
    assert modes == [True] * p + [False] * p  # both measured, on first
    # then the faster mode, and the other once per 1 / EXPLORE_SHARE of its phase's time
    # (equal phase times here: once every 33 phases)
    period = round(1 / SpecPacer.EXPLORE_SHARE) + 1
    modes = loop.run(2 * period * p, 32, 0.05, lambda m: slow[m])
    phases = [modes[i] for i in range(0, len(modes), p)]
    assert phases.count(True) == 2 and phases.count(False) == 2 * period - 2
    # 1 running, another level: drafts pay there
    fast = {True: 3, False: 1}
    modes = loop.run((2 + period) * p, 1, 0.02, lambda m: fast[m])
    phases = [modes[i] for i in range(0, len(modes), p)][2:]
    assert phases.count(True) == period - 1 and phases.count(False) == 1
    level32 = pacer.buckets[(32).bit_length()]
    assert level32.rate[False] > level32.rate[True]  # untouched by level 1's steps


def test_a_much_slower_mode_is_tried_more_rarely() -> None:
    """The other mode's tries are bounded by time: when its steps take 4x as long, it is
    tried once in 4x as many phases of the faster mode."""
    pacer = SpecPacer()
    loop = _Loop(pacer)
    p = SpecPacer.PHASE
    n = 200 * p
    for mode_first in (True, False):  # both measured: on (slow steps), then off
        assert pacer.speculate(32) is mode_first
        loop.run(p, 32, 0.2 if mode_first else 0.05, lambda m: 32)
    modes, t_on, t_all = [], 0.0, 0.0
    for _ in range(n):
        mode = pacer.speculate(32)
        seconds = 0.2 if mode else 0.05
        modes += loop.run(1, 32, seconds, lambda m: 32)
        t_all += seconds
        t_on += seconds if mode else 0.0
    assert 0 < t_on / t_all <= 1.5 * SpecPacer.EXPLORE_SHARE


def test_prompt_steps_and_idle_time_are_not_measured() -> None:
    pacer = SpecPacer()
    loop = _Loop(pacer)
    p = SpecPacer.PHASE
    # steps with prompt tokens do not advance a phase
    assert loop.run(3 * p, 4, 0.05, lambda m: 4, prefill=True) == [True] * (3 * p)
    assert not pacer.buckets[(4).bit_length()].rate
    # an idle engine between two steps: the second step's time starts at its scheduling
    loop.run(p // 2, 4, 0.05, lambda m: 4)
    loop.now += 100.0
    loop.run(p - p // 2, 4, 0.05, lambda m: 4)
    assert pacer.buckets[(4).bit_length()].rate[True] == pytest.approx(4 / 0.05)


def test_a_failed_step_does_not_grow_the_pacer() -> None:
    pacer = SpecPacer()
    for i in range(1000):  # scheduled, never updated
        pacer.scheduled(i, float(i), 8, True, True)
    assert len(pacer._steps) <= 65

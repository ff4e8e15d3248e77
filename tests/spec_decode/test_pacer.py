"""``SpecPacer`` (``disable_when_slower``): speculation on or off per load level from the
measured step times of both modes and the measured acceptance, with a clock the test drives."""

from __future__ import annotations

import pytest

from pagedllm.core.sched.spec import SpecPacer

P = SpecPacer.PHASE


class _Loop:
    """Steps through a pacer: a step at ``running`` requests takes ``step_s[mode]`` and each
    request accepts ``accepted`` drafts (sampled from the verification while speculating; from
    shadow drafts while paused). Returns the mode of each step."""

    def __init__(self, pacer: SpecPacer) -> None:
        self.pacer, self.now, self.step = pacer, 0.0, 0
        self.last_mode: bool | None = None
        self.time_in = {True: 0.0, False: 0.0}

    def run(
        self,
        n: int,
        running: int,
        step_s: dict,
        accepted: int,
        prompt_tokens=0,
        prompt_token_s=0.0,
        host_s=None,
        idle_after=False,
        switch_on_s=0.0,
        finish_s=0.0,
        arrivals=0,
    ) -> list:
        """``host_s[mode]``: host time between an update and the next step's scheduling
        (output processing, drafting) that the step waits for; ``idle_after``: the last step's
        update leaves the engine without requests; ``switch_on_s``: extra time of the first
        speculating step after a plain one (the proposer catching up); ``finish_s``: time in
        each step the proposer spends on ending requests (reported as the engine does);
        ``prompt_tokens``: a prompt chunk in every step, costing ``prompt_token_s`` a token;
        ``arrivals``: the requests each step admits."""
        modes = []
        for i in range(n):
            mode = self.pacer.speculate(running)
            t_start = self.now
            self.now += (host_s or {}).get(mode, 0.0)
            if mode and self.last_mode is False:
                self.now += switch_on_s
            self.pacer.scheduled(self.step, t_start, running, mode, prompt_tokens, arrivals)
            self.now += step_s[mode] + finish_s + prompt_tokens * prompt_token_s
            self.pacer.not_timed_s += finish_s
            for _ in range(running):
                self.pacer.sample(accepted)
            self.pacer.updated(self.step, self.now, not (idle_after and i == n - 1))
            self.step += 1
            self.last_mode = mode
            self.time_in[mode] += self.now - t_start
            modes.append(mode)
        return modes


def _phases(modes: list) -> list:
    return [modes[i] for i in range(0, len(modes), P)]


def test_each_load_runs_the_mode_the_rule_picks() -> None:
    """(1 + a) * t_off > t_on: at 32 running a = 0.5 does not pay for steps 1.6x as long; at
    1 running a = 2 pays for steps 1.5x as long."""
    pacer = SpecPacer()
    loop = _Loop(pacer)
    heavy = {True: 0.08, False: 0.05}
    assert _phases(loop.run(2 * P, 32, heavy, 1)) == [True, False]  # both measured, on first
    modes = loop.run(10 * P, 32, heavy, 1)  # a -> 1: 2 x 0.05 > 0.08, speculation pays
    assert _phases(modes)[-1] is True
    for _ in range(20 * 32):
        pacer.sample(0)  # the content changes: nothing accepted any more
    modes = loop.run(10 * P, 32, heavy, 0)  # (on wins by MARGIN till the average falls)
    assert _phases(modes)[2:].count(True) == 0
    # another level: its own step times; it starts in the mode its measured neighbour picks
    # (off at 32, with nothing accepted there), then measures the other one
    light = {True: 0.03, False: 0.02}
    assert loop.run(1, 1, light, 2) == [False]  # the step the load moves in: not timed
    modes = loop.run(20 * P, 1, light, 2)
    assert _phases(modes)[:2] == [False, True] and all(_phases(modes)[-5:])


def test_a_new_level_starts_in_its_nearest_measured_levels_mode() -> None:
    """Speculation measured slower at 256 running: requests that finish one by one bring
    the load through 128-255, 64-127, ...; those levels start off (their first phase is the
    neighbour's mode, not a costly speculating one), down to where a level measured on."""
    pacer = SpecPacer()
    loop = _Loop(pacer)
    loop.run(12 * P, 256, {True: 0.04, False: 0.006}, 1)  # off pays at 256
    loop.run(12 * P, 1, {True: 0.002, False: 0.0016}, 2)  # on pays at 1
    assert not pacer.speculate(200) and not pacer.speculate(64)
    assert pacer.speculate(2)  # nearer to 1 than to 256
    assert pacer.buckets[(200).bit_length()].scheduled[True] == 0


def test_the_other_mode_is_timed_again_within_a_small_share_of_the_time() -> None:
    """Steps with drafts 4x as long and nothing accepted: the pacer stays off and measures a
    speculating phase again only once per 1 / EXPLORE_SHARE of that phase's time."""
    pacer = SpecPacer()
    loop = _Loop(pacer)
    step_s = {True: 0.2, False: 0.05}
    loop.run(2 * P, 32, step_s, 0)
    t_on = t_all = 0.0
    for _ in range(400 * P):
        mode = loop.run(1, 32, step_s, 0)[0]
        t_all += step_s[mode]
        t_on += step_s[mode] if mode else 0.0
    assert 0 < t_on / t_all <= 1.5 * SpecPacer.EXPLORE_SHARE


def test_re_timings_that_confirm_the_choice_come_ever_more_rarely() -> None:
    """Under a steady load where speculation keeps losing, each re-timing that confirms
    "off" doubles the time to the next one, up to MAX_BACKOFF: the speculating share falls
    to ~EXPLORE_SHARE / MAX_BACKOFF. A re-timing that finds speculation paying (the
    acceptance rose) keeps it on and starts the intervals over."""
    pacer = SpecPacer()
    loop = _Loop(pacer)
    step_s = {True: 0.2, False: 0.05}
    loop.run(2 * P, 32, step_s, 0)
    b = pacer.buckets[(32).bit_length()]
    starts = []  # the step at which each re-timing phase began
    for i in range(6000 * P):
        mode = loop.run(1, 32, step_s, 0)[0]
        if mode and (not starts or starts[-1] < i - P):
            starts.append(i)
    # the first re-timing came after the base interval, the next after 2x, 4x, 8x, 8x it
    gaps = [b2 - b1 for b1, b2 in zip(starts, starts[1:])]
    assert len(gaps) >= 4
    assert gaps[1] == pytest.approx(2 * gaps[0], rel=0.05)
    assert gaps[2] == pytest.approx(4 * gaps[0], rel=0.05)
    assert gaps[3] == pytest.approx(gaps[2], rel=0.05)  # capped: MAX_BACKOFF
    assert b.backoff == SpecPacer.MAX_BACKOFF
    loop.time_in = {True: 0.0, False: 0.0}
    loop.run(2 * gaps[-1], 32, step_s, 0)
    share = loop.time_in[True] / (loop.time_in[True] + loop.time_in[False])
    assert 0 < share <= 1.5 * SpecPacer.EXPLORE_SHARE / SpecPacer.MAX_BACKOFF
    # the acceptance rises: the next re-timing finds 1 + 4 accepted x 50 ms > 200 ms
    while not loop.run(1, 32, step_s, 4)[0]:
        pass
    loop.run(P, 32, step_s, 4)
    assert b.mode is True and b.backoff == 1


def test_speculation_that_cannot_pay_even_fully_accepted_is_rarely_re_timed() -> None:
    """k = 4: speculating steps more than 5x a plain one cannot pay whatever is accepted.
    Such a level re-times at the longest interval from its first choice on, and a new level
    above it starts off and takes that ratio for its speculating steps instead of timing
    them (suffix decoding's first step after a pause is dear); the first re-timing there
    measures it, after MAX_BACKOFF / EXPLORE_SHARE times its estimated phase."""
    pacer = SpecPacer(max_accepted=4)
    loop = _Loop(pacer)
    loop.run(2 * P, 64, {True: 0.03, False: 0.005}, 1)  # on 6x off: hopeless
    b64 = pacer.buckets[(64).bit_length()]
    assert b64.mode is False and b64.backoff == SpecPacer.MAX_BACKOFF
    heavy = {True: 0.08, False: 0.01}
    assert loop.run(4 * P, 256, heavy, 1).count(True) == 0  # never timed on
    b = pacer.buckets[(256).bit_length()]
    assert b.step_s[True] == pytest.approx(0.06)  # 10 ms x 6
    assert b.backoff == SpecPacer.MAX_BACKOFF and b.scheduled[True] == 0
    # 8 x 32 x its estimated on-phase (8 x 60 ms): 123 s counted of off phases (7 of their 8
    # steps of 10 ms count): ~14,000 steps
    modes = loop.run(16_000, 256, heavy, 1)
    first = modes.index(True)
    assert 13_000 < first < 15_000
    assert b.step_s[True] == pytest.approx(0.08, rel=0.2)  # now measured
    # a pacer that does not know k times speculation at 256 at once
    other = SpecPacer()
    loop2 = _Loop(other)
    loop2.run(2 * P, 64, {True: 0.03, False: 0.005}, 1)
    assert loop2.run(4 * P, 256, heavy, 1).count(True) == P


def test_a_level_below_a_hopeless_one_does_not_time_speculation_at_first() -> None:
    """At 256 speculation is hopeless, at 1 it pays; the load then settles at 200 (a level
    between): it starts off (the nearer measured level's choice), and after its first phase
    takes 256's ratio of the two modes instead of timing speculation - the H200 timed it
    at 254 running, where suffix decoding's first speculating step cost 350 ms."""
    pacer = SpecPacer(max_accepted=4)
    loop = _Loop(pacer)
    loop.run(4 * P, 1, {True: 0.002, False: 0.0016}, 2)  # pays at 1
    loop.run(4 * P, 256, {True: 0.04, False: 0.005}, 1)  # 8x: hopeless at 256
    mid = {True: 0.3, False: 0.004}
    loop.run(1, 200, mid, 1)  # the step the load moves in: not timed
    assert loop.run(6 * P, 200, mid, 1).count(True) == 0
    b = pacer.buckets[(200).bit_length()]
    assert b.step_s[True] == pytest.approx(0.032)  # 4 ms x 8
    assert b.backoff == SpecPacer.MAX_BACKOFF


@pytest.mark.parametrize("switch_on_s", [0.3, 0.01])
def test_a_rise_of_the_acceptance_switches_on_only_where_the_switch_pays(switch_on_s) -> None:
    """Off was chosen at 256 (on 14 ms, off 4 ms, 1 accepted); the acceptance rises to 3:
    (1 + 3) x 4 > 14 ms, so speculating steps would pay 2 ms each, but suffix decoding's
    first speculating step after a pause catches up on every request's tokens (0.3 s here,
    measured as that step's excess the last time): the level stays off. Where the switch is
    cheap (10 ms) it turns speculation on."""
    pacer = SpecPacer(max_accepted=4)
    loop = _Loop(pacer)
    loop.run(2 * P, 1, {True: 0.004, False: 0.002}, 0)  # off at 1: a new level starts off
    full = {True: 0.014, False: 0.004}
    loop.run(1, 256, full, 1)  # the step the load moves in: not timed
    modes = loop.run(4 * P, 256, full, 1, switch_on_s=switch_on_s)
    assert _phases(modes) == [False, True, False, False]
    b = pacer.buckets[(256).bit_length()]
    assert b.switch_s == pytest.approx(switch_on_s)
    for _ in range(20):
        pacer.sample(3)
        pacer.updated(-1, loop.now, True)  # (an unknown step: folds the acceptance only)
    modes = loop.run(20 * P, 256, full, 3, switch_on_s=switch_on_s)
    assert any(modes) == (switch_on_s < 0.064)  # 2 ms x SWITCH_STEPS


def test_a_re_timing_cut_short_by_the_batchs_end_is_given_up() -> None:
    """A re-timing of speculation began two steps before the batch ended. The next batch
    does not go on with it: on a fresh batch suffix decoding's speculating steps are the
    cheapest, and would be timed as the level's (after a catch-up on every request)."""
    pacer = SpecPacer()
    loop = _Loop(pacer)
    heavy = {True: 0.03, False: 0.01}
    loop.run(2 * P, 16, heavy, 0)  # on, then off: off chosen
    modes: list = []
    while not modes or not modes[-1]:
        modes += loop.run(1, 16, heavy, 0)  # until the re-timing of speculation begins
    loop.run(1, 16, heavy, 0, idle_after=True)
    b = pacer.buckets[(16).bit_length()]
    assert b.exploring and b.steps == 2
    modes = loop.run(3 * P, 16, heavy, 0)
    assert not any(modes) and not b.exploring


def test_shadow_drafts_measure_the_acceptance_while_paused() -> None:
    pacer = SpecPacer()
    tokens = [1, 2, 3]
    drafts = iter([[4, 5, 9], [], [7]])
    propose = lambda: next(drafts)  # noqa: E731
    pacer.shadow("r", tokens, False, propose)  # drafts [4, 5, 9] after 3 tokens
    assert pacer.samples == 0
    for t in (4, 5):
        tokens.append(t)
        pacer.shadow("r", tokens, False, propose)  # not enough tokens yet to check
    assert pacer.samples == 0
    tokens.append(6)  # 4, 5 accepted, 6 != 9; then the proposer has nothing (0 accepted)
    pacer.shadow("r", tokens, False, propose)
    assert pacer.samples == 2 and pacer.accepted == pytest.approx(1.0)
    tokens.append(8)  # drafts [7] after 7 tokens; the request ends: 8 != 7
    pacer.shadow("r", tokens, False, propose)
    pacer.shadow("r", tokens + [8], True, propose)
    assert pacer.samples == 3 and pacer.accepted == pytest.approx(2 / 3)
    assert not pacer._shadow


def test_shadow_drafts_follow_a_few_requests_at_once() -> None:
    """At 256 running the host drafts for SHADOWED requests, not for every one; when one
    ends, another takes its place."""
    pacer = SpecPacer()
    n = SpecPacer.SHADOWED
    calls: list[int] = []
    toks = {i: [1, 2, 3] for i in range(256)}
    for _ in range(3):  # tokens 4, 5, 6: the drafts [5, 6, 7, 8, 9] after 4 stay undecided
        for i in range(256):
            toks[i].append(toks[i][-1] + 1)
            pacer.shadow(f"r{i}", toks[i], False, lambda i=i: calls.append(i) or [5, 6, 7, 8, 9])
    assert sorted(set(calls)) == list(range(n)) and len(calls) == n
    pacer.shadow("r0", toks[0] + [0], True, lambda: [1])  # r0 ends: 5, 6 accepted, 0 != 7
    assert pacer.samples == 1 and pacer.accepted == 2.0
    pacer.shadow(f"r{n}", toks[n] + [0], False, lambda: calls.append(n) or [2])
    assert calls[-1] == n


def test_prompt_steps_and_idle_time_are_not_measured() -> None:
    pacer = SpecPacer()
    loop = _Loop(pacer)
    step_s = {True: 0.05, False: 0.05}
    # steps with prompt tokens do not advance a phase while a prompt token's cost is unknown
    assert loop.run(3 * P, 4, step_s, 1, prompt_tokens=100) == [True] * (3 * P)
    assert pacer.prompt_token_s is None
    assert not pacer.buckets[(4).bit_length()].step_s
    # an idle engine between two steps: the second step's time starts at its scheduling, and
    # a phase is steps of one stretch (the half phase before the pause starts over)
    loop.run(P // 2, 4, step_s, 1, idle_after=True)
    loop.now += 100.0
    loop.run(P - P // 2, 4, step_s, 1)
    b = pacer.buckets[(4).bit_length()]
    assert not b.step_s and b.steps == P - P // 2
    loop.run(P // 2, 4, step_s, 1)
    assert b.step_s[True] == pytest.approx(0.05)
    assert b.phase_cost_s[True] == pytest.approx(P * 0.05)  # its first step: not the pause


def test_steps_with_prompt_tokens_count_less_their_cost() -> None:
    """Under steady arrivals most steps carry a prompt chunk. A prompt token's cost is learned
    from prompt steps at a level whose decode-only steps were timed; then such steps count
    less that cost, and a level where every step has a prompt chunk still times both modes
    and runs the one the rule picks (before, none of its phases ever completed)."""
    pacer = SpecPacer()
    loop = _Loop(pacer)
    per_token = 1e-5
    light = {True: 0.004, False: 0.003}
    loop.run(4 * P, 16, light, 2)  # decode-only steps: on pays at 16 (3 x 3 ms > 4 ms)
    # with a re-timing of off among them, and a 1 s switch back on (suffix decoding catching
    # up), which must not read as prompt-token cost
    pacer.buckets[(16).bit_length()].since_explore_s = 100.0
    modes = loop.run(
        4 * P, 16, light, 2, prompt_tokens=500, prompt_token_s=per_token, switch_on_s=1.0
    )
    assert False in modes and modes[-1] is True
    assert pacer.prompt_token_s == pytest.approx(per_token)
    # every step at 256 running has a 2,000-token chunk (20 ms); speculating 30 ms a step
    # against 6 ms, 1 draft accepted: off (2 x 6 < 30). Timed with the chunks, 2 x 26 > 50
    # would keep it on
    heavy = {True: 0.03, False: 0.006}
    modes = loop.run(12 * P, 256, heavy, 1, prompt_tokens=2000, prompt_token_s=per_token)
    assert pacer.buckets[(256).bit_length()].step_s == pytest.approx(heavy)
    assert _phases(modes)[2:].count(True) <= 1


def test_the_host_work_before_a_step_counts() -> None:
    """Drafting on the host before a synchronous step is part of its time: 1 ms on the device
    and 9 ms of drafting make a 10 ms step, which 1 accepted draft does not pay for against 3
    ms steps without drafts."""
    pacer = SpecPacer()
    loop = _Loop(pacer)
    modes = loop.run(10 * P, 64, {True: 0.001, False: 0.003}, 1, host_s={True: 0.009})
    assert pacer.buckets[(64).bit_length()].step_s[True] == pytest.approx(0.010)
    assert _phases(modes)[2:].count(True) <= 1


def test_a_level_the_load_only_passes_through_is_not_timed_and_follows_its_neighbour() -> None:
    """Offline batches: every request arrives at once, so a batch's second step runs at ~160
    of its 256 requests and admits the other 96, and all end together. That level is made
    before any is measured (its guess: speculate); its steps admit a burst of requests and
    are not timed (admitting requests costs host work the prompt tokens' learned cost does
    not hold), so it never measures itself: once 256 is measured off, it follows that level,
    and its steps stop speculating."""
    pacer = SpecPacer()
    loop = _Loop(pacer)
    mid = {True: 0.05, False: 0.03}
    full = {True: 0.04, False: 0.004}
    cost = 2e-5  # s a prompt token
    ramp = dict(prompt_tokens=1000, prompt_token_s=cost, arrivals=96)
    loop.run(1, 160, mid, 1, **ramp)  # the first batch: level 160 made before any is measured
    loop.run(3 * P, 256, full, 1, idle_after=True)
    # 256 running under steady arrivals (one a step): a prompt token's cost is learned
    steady = dict(prompt_tokens=50, prompt_token_s=cost, arrivals=1)
    loop.run(4 * P, 256, full, 1, idle_after=True, **steady)
    assert pacer.prompt_token_s == pytest.approx(cost)
    for _ in range(12):  # more batches: one step at 160 running after the idle end, then 256
        loop.run(1, 160, mid, 1, **ramp)
        loop.run(3 * P, 256, full, 1, idle_after=True)
    b160 = pacer.buckets[(160).bit_length()]
    assert not b160.step_s and not b160.decode_s  # never timed
    assert b160.scheduled[True] == 1  # the first batch's guess only
    assert not pacer.speculate(160)


def test_the_tail_of_a_batch_that_ends_together_is_not_timed() -> None:
    """Requests admitted in one step end in one: an offline batch of 256 ends 256 -> 192 ->
    129 -> 66 running, a step at each. Those levels are never timed (their steps come after
    a jump of the load) and follow the measured level, off: timed, each got its steps and a
    phase from the tails, and went on to time speculation there, where suffix decoding's
    first speculating step catches up on hundreds of requests (0.3 s here)."""
    pacer = SpecPacer(max_accepted=4)
    loop = _Loop(pacer)
    full = {True: 0.04, False: 0.004}
    tail = {True: 0.3, False: 0.003}
    for _ in range(8):
        loop.run(4 * P, 256, full, 1)
        for n in (192, 129, 66):
            loop.run(1, n, tail, 1)
        loop.run(1, 3, tail, 1, idle_after=True)
    for n in (192, 66, 3):
        b = pacer.buckets[n.bit_length()]
        assert not b.step_s and b.steps == 0 and b.scheduled[True] == 0
    assert not pacer.speculate(150)


def test_a_level_where_speculation_comes_to_pay_turns_on_and_stays_on() -> None:
    """Off was better; then the acceptance rises (shadow drafts see it while paused): the
    level turns speculation on and keeps it instead of exploring off at once (the time
    counted towards the next exploration starts again at each switch)."""
    pacer = SpecPacer()
    loop = _Loop(pacer)
    heavy = {True: 0.04, False: 0.01}
    loop.run(2 * P, 64, heavy, 0)  # on, then off measured; nothing accepted: off
    b = pacer.buckets[(64).bit_length()]
    b.since_explore_s = 100.0  # long in off: a re-timing is due
    modes = loop.run(8 * P, 64, heavy, 4)  # 4 accepted: 5 x 10 ms > 40 ms (+ MARGIN)
    assert b.mode is True and all(_phases(modes)[-3:])
    assert all(loop.run(4 * P, 64, heavy, 4))


def test_a_level_visited_a_step_at_a_time_follows_the_acceptance_of_now() -> None:
    """Speculation paid at 200 running while 2 drafts were accepted; then the content
    changes (nothing accepted, seen at 16 running). The load comes back to 200 a single step
    at a time (the end of each batch), so no phase there completes: the level applies the
    rule at each visit with the acceptance of now instead of keeping its old choice."""
    pacer = SpecPacer()
    loop = _Loop(pacer)
    loop.run(2 * P, 200, {True: 0.01, False: 0.006}, 2)  # 3 x 6 > 10 ms: on
    assert pacer.speculate(200)
    loop.run(1, 16, {True: 0.004, False: 0.002}, 0)
    loop.run(40 * P, 16, {True: 0.004, False: 0.002}, 0)
    for _ in range(3):
        assert loop.run(1, 200, {True: 0.01, False: 0.006}, 0, idle_after=True) == [False]


def test_a_level_with_a_step_at_each_batchs_end_follows_its_neighbours_choice() -> None:
    """Speculation pays at 64 running. The first batch of 256 reaches 255 running (128-255)
    after one phase at 256, before 256 has both modes timed: that step follows 64's choice,
    speculating. Each later batch ends with one step at 255, a phase begun and dropped; that
    level follows its neighbours' choice of now (256 measured off) and stops speculating -
    the H200 ran those steps speculating batch after batch, each a 0.3 s catch-up of suffix
    decoding's trees for 255 requests."""
    pacer = SpecPacer(max_accepted=4)
    loop = _Loop(pacer)
    loop.run(2 * P, 64, {True: 0.004, False: 0.002}, 2)  # 3 x 2 > 4 ms: on at 64
    full = {True: 0.03, False: 0.004}
    loop.run(1, 256, full, 1)  # the load moves in: not timed
    loop.run(P, 256, full, 1)  # its first phase: speculating (64's choice)
    assert loop.run(1, 255, full, 1, idle_after=True) == [True]
    for _ in range(5):
        loop.run(1, 256, full, 1)
        loop.run(3 * P, 256, full, 1)
        tail = loop.run(1, 255, full, 1, idle_after=True)
    assert tail == [False]
    assert pacer.buckets[(255).bit_length()].scheduled[True] == 1


def test_a_level_with_one_mode_timed_begins_each_stretch_in_it() -> None:
    """Off was timed at 200 running (its neighbour's choice); speculation is next to time.
    The load then comes back to 200 a single step at a time: those steps run off, the mode
    timed, and speculation is timed after a phase of off in one stretch."""
    pacer = SpecPacer()
    loop = _Loop(pacer)
    loop.run(2 * P, 16, {True: 0.004, False: 0.002}, 0)  # off at 16
    mid = {True: 0.3, False: 0.004}
    loop.run(1, 200, mid, 0)  # the load moves in: not timed
    loop.run(P, 200, mid, 0, idle_after=True)
    b = pacer.buckets[(200).bit_length()]
    assert list(b.step_s) == [False] and b.mode is True  # on to time next
    for _ in range(5):
        assert loop.run(1, 200, mid, 0, idle_after=True) == [False]
    modes = loop.run(2 * P, 200, mid, 0)  # a longer stretch: a phase off, then on timed
    assert not any(modes[:P]) and all(modes[P:])


def test_a_level_at_the_edge_keeps_its_mode() -> None:
    """t_on 2.8 ms, t_off 1.5 ms: speculation pays above a = 0.87, and the acceptance moves
    0.8-0.93 from phase to phase. Without a margin the level switched every few phases (and
    each switch costs steps the rule does not see); against its chosen mode the other has
    to win by ``MARGIN``, so it keeps the mode it chose."""
    pacer = SpecPacer()
    loop = _Loop(pacer)
    edge = {True: 0.0028, False: 0.0015}
    modes = []
    for i in range(40):
        modes += loop.run(P, 16, edge, 0.93 if i % 4 < 2 else 0.8)
    switches = sum(x != y for x, y in zip(modes, modes[1:]))
    assert switches <= 6  # the first choice and re-timings (without the margin: 21)


def test_a_mode_timed_at_zero_seconds_is_compared_without_dividing_by_it() -> None:
    """A step counts 0 s where its prompt chunk's learned cost exceeds its time; a phase of
    such speculating steps gives t_on = 0, and the rule still answers (speculate: it costs
    nothing), with its margin against the chosen mode too."""
    pacer = SpecPacer()
    loop = _Loop(pacer)
    modes = loop.run(4 * P, 4, {True: 0.0, False: 0.002}, 0)
    assert pacer.buckets[(4).bit_length()].step_s[True] == 0.0 and modes[-1] is True
    # plain steps at 0 s where speculation is hopeless (any t_on > 0): a level next to it
    # cannot take its ratio, and times speculation itself
    other = SpecPacer(max_accepted=4)
    loop = _Loop(other)
    loop.run(4 * P, 256, {True: 0.01, False: 0.0}, 0)
    loop.run(1, 100, {True: 0.01, False: 0.002}, 0)  # the load moves in: not timed
    modes = loop.run(3 * P, 100, {True: 0.01, False: 0.002}, 0)
    assert modes.count(True) == P  # its second phase


def test_the_acceptance_is_averaged_over_steps_not_opportunities() -> None:
    """256 requests a step, alternating steps of all drafts accepted and none: the average
    stays near the middle instead of following the last step (each step's mean is one
    sample of the average)."""
    pacer = SpecPacer()
    loop = _Loop(pacer)
    seen = []
    for i in range(64):
        loop.run(1, 256, {True: 0.02, False: 0.01}, 4 if i % 2 else 0)
        seen.append(pacer.accepted)
    assert all(1.4 < a < 2.6 for a in seen[32:])


def test_exploring_costs_a_small_share_even_when_switching_on_is_dear() -> None:
    """Each switch to speculation costs 1 s once (suffix decoding's trees catching up on the
    paused stretch) besides 40 ms steps against 6 ms: speculation is re-timed rarely enough
    that all its time, switches included, stays near EXPLORE_SHARE of the whole."""
    pacer = SpecPacer()
    loop = _Loop(pacer)
    step_s = {True: 0.04, False: 0.006}
    loop.run(4 * P, 256, step_s, 1, switch_on_s=1.0)
    loop.time_in = {True: 0.0, False: 0.0}
    loop.run(3000 * P, 256, step_s, 1, switch_on_s=1.0)
    share = loop.time_in[True] / (loop.time_in[True] + loop.time_in[False])
    assert 0 < share <= 1.5 * SpecPacer.EXPLORE_SHARE


def test_the_proposers_work_for_ending_requests_is_not_timed() -> None:
    """All requests of a batch run without drafts end in the same step, whose host work for
    them (suffix decoding's global tree learning every output) would read as a slow plain
    step; under steady traffic requests end in most steps, which are still timed."""
    pacer = SpecPacer()
    loop = _Loop(pacer)
    step_s = {True: 0.004, False: 0.002}
    loop.run(P, 16, step_s, 1)  # on measured
    loop.run(P - 1, 16, step_s, 1)
    loop.run(1, 16, step_s, 1, finish_s=0.5)  # the whole batch ends
    assert pacer.buckets[(16).bit_length()].step_s[False] == pytest.approx(0.002)
    loop.run(20 * P, 64, step_s, 1, finish_s=0.0003)  # some request ends every step
    assert pacer.buckets[(64).bit_length()].step_s == pytest.approx(step_s)


def test_spec_decoding_reports_the_proposers_time_for_an_ending_request(monkeypatch) -> None:
    from types import SimpleNamespace

    from pagedllm.core.sched import spec as spec_mod
    from pagedllm.spec_decode import SpeculativeConfig

    clock = [100.0]
    monkeypatch.setattr(spec_mod.time, "perf_counter", lambda: clock[0])
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=4, disable_when_slower=True)
    spec = spec_mod.SpecDecoding(config, max_model_len=1000)
    monkeypatch.setattr(spec.proposer, "finish", lambda *a: clock.__setitem__(0, clock[0] + 0.25))
    spec.finish(SimpleNamespace(request_id="r", all_token_ids=[1, 2, 3], num_prompt_tokens=2))
    assert spec.pacer.not_timed_s == pytest.approx(0.25)


def test_a_failed_step_does_not_grow_the_pacer() -> None:
    pacer = SpecPacer()
    for i in range(1000):  # scheduled, never updated
        pacer.scheduled(i, float(i), 8, True, 0)
    assert len(pacer._steps) <= 65


def test_paused_suffix_decoding_learns_only_from_followed_requests() -> None:
    """While paused, suffix decoding's global tree takes the outputs of the requests the
    shadow drafts follow, not every request's (its host time per token at 256 running)."""
    from types import SimpleNamespace

    from pagedllm.core.sched.spec import SpecDecoding
    from pagedllm.spec_decode import SpeculativeConfig

    config = SpeculativeConfig(method="suffix", num_speculative_tokens=4, disable_when_slower=True)
    spec = SpecDecoding(config, max_model_len=1000)
    pacer = spec.pacer
    prompt, output = [1, 2, 3], [50, 51, 52, 53, 54, 55]

    def req(rid: str) -> SimpleNamespace:
        return SimpleNamespace(request_id=rid, all_token_ids=prompt + output, num_prompt_tokens=3)

    def drafts_after(rid: str) -> list[int]:  # a new request that has just produced 50, 51
        return spec.proposer.propose(rid, [9, 9, 50, 51], 2, 4)

    pacer.scheduled(0, 0.0, 256, False, 0)  # a paused step
    spec.finish(req("unfollowed"))
    assert drafts_after("n1") == []
    pacer.shadow("followed", prompt + output[:1], False, lambda: [7])
    spec.finish(req("followed"))
    assert drafts_after("n2") == [52, 53]  # 2 matched tokens: 2 drafts (max_spec_factor 1)
    pacer.scheduled(1, 0.0, 256, True, 0)  # speculating again: every output is learned
    output[:] = [60, 61, 62, 63]
    spec.finish(req("any"))
    assert spec.proposer.propose("n3", [9, 60, 61], 1, 4) == [62, 63]


def test_the_pacer_pauses_while_a_burst_of_requests_waits() -> None:
    """More than max(2, running / 16) waiting requests (an offline batch being admitted, or
    an engine over capacity) pause speculation at any level; fewer leave it to the pacer's
    rule; without ``disable_when_slower`` a queue changes nothing."""
    from pagedllm.core.sched.spec import SpecDecoding
    from pagedllm.spec_decode import SpeculativeConfig

    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    paced = SpecDecoding(
        SpeculativeConfig.from_dict({**ngram, "disable_when_slower": True}), max_model_len=1000
    )
    assert not paced.paused(4, 2)  # a new level, nothing measured: speculate
    assert paced.paused(4, 3)
    assert not paced.paused(64, 4) and paced.paused(64, 5)
    plain = SpecDecoding(SpeculativeConfig.from_dict(ngram), max_model_len=1000)
    assert not plain.paused(64, 500)

"""The scheduler's side of speculative decoding: drafts before a step, acceptance after it.

Before a request decodes, a proposer (``pagedllm/spec_decode``) guesses up to k tokens after
its known ones; the scheduler schedules the request 1 + k tokens (its last known token, then
the drafts) and the runner samples at each of the k + 1 positions: sample j is the model's
token after draft j - 1 (see ``SchedulerOutput.scheduled_spec_tokens``). Acceptance keeps
the longest prefix of drafts that equal the samples, then the model's own sample after it.

Why this is lossless. The drafts here are deterministic (a proposer's guess, with no
probabilities of its own): in the rejection-sampling rule of speculative decoding that is a
draft distribution q putting all its mass on the draft d. The rule accepts d with probability
min(1, p(d) / q(d)) = p(d) and, on rejection, samples from the residual max(p - q, 0)
renormalized, which is p with d removed. Sampling s ~ p at each position and accepting d when
s == d does exactly that: P(accept) = p(d), and a rejected position's s is distributed as p
given s != d. Each position's p is the target's distribution with the request's sampling
parameters (temperature, top-k/p, min-p, penalties and min_tokens over the output plus the
drafts before it: ``worker/sampling_inputs.py``), so every emitted token has the distribution
it would have without speculation. A request with a ``seed`` draws each position's noise from
(seed, output position), so its tokens are even the same ones as without speculation.

A structured request's grammar masks every position: its matcher accepts the drafts for the
fill, one bitmask row per position, then rolls them back (``structured_output/matchers.py``);
only the accepted tokens enter it at the update. Beam searches get no drafts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.request import Request
from pagedllm.spec_decode import SpeculativeConfig, make_proposer


@dataclass
class _Bucket:
    """A load level's measurements: each mode's seconds a step, less any prompt chunk's cost
    (exponential averages), the current phase, and the time in the chosen mode since the
    other ran."""

    step_s: dict[bool, float] = field(default_factory=dict)  # speculating -> s a step
    # decode-only steps alone (an average over steps): what a prompt step's extra time is
    # measured against (not step_s, which prompt steps feed once their cost is known)
    decode_s: dict[bool, float] = field(default_factory=dict)
    mode: bool = True  # the current phase's
    steps: int = 0  # steps of the current phase seen
    first_s: float = 0.0  # the time of its first step (not in the mode's step time)
    times: list[float] = field(default_factory=list)  # its steps after the first
    phase_cost_s: dict[bool, float] = field(default_factory=dict)  # the last phase per mode
    since_explore_s: float = 0.0
    epoch: int = 0  # SpecPacer._epoch at the current phase's last step
    # a speculating phase's first step beyond the phase's median: the largest recent one
    switch_s: float = 0.0
    decided: bool = False  # the rule chose a mode here once (both measured)
    # the current phase re-times the mode not chosen; each re-timing that confirms the
    # choice doubles the time to the next one (up to SpecPacer.MAX_BACKOFF times)
    exploring: bool = False
    backoff: int = 1
    scheduled: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})  # steps


class SpecPacer:
    """Turns speculation off at the loads where it is slower (``disable_when_slower``).

    A speculating step emits ``1 + a`` tokens per request (``a``: drafts accepted) and takes
    ``t_on``; a plain step emits 1 and takes ``t_off``. Speculation pays at a load where
    ``(1 + a) * t_off > t_on``. The pacer measures both sides:

    - ``a``: drafts accepted per drafting opportunity (one per request and step), an
      exponential average over steps of each step's mean,
      from the verifications while speculating and, while paused, from shadow drafts: the
      proposer drafts as it would have, and the drafts are checked against the tokens the
      model then emits (``shadow``; not for a draft model, whose drafts come from the runner).
      The acceptance moves with the content, so this is measured all the time.
    - ``t_on`` and ``t_off`` per load level (bucket: running requests rounded down to a power of
      two; a new level starts in the mode its nearest measured level picks): the wall time of
      steps from the previous step's update to their own, in phases of ``PHASE``
      steps of one mode (a phase gives the median of its steps, an exponential average
      over phases the mode's time) - so a step's time holds all the host work of the engine
      loop: the output processing, the scheduling and the drafting before a synchronous step (a
      speculating one) as well as the overlapped ones of an asynchronous step. A phase's first
      step is not counted (the switch between synchronous and asynchronous steps), nor the
      engine's idle time (a step after an update that left no work starts at its own
      scheduling), nor the proposer's work for ending requests. A step with prompt tokens
      counts less their cost: ``prompt_token_s`` seconds each, learned from such steps at a
      level and mode whose decode-only steps have been timed (the ratio of the average extra
      time over those to the average prompt tokens; one figure for every level, as a prompt
      token's cost does not depend on the mode); until one is learned they are not counted.
      So phases complete under steady arrivals too, where most steps carry a prompt chunk.
      A level measures its first mode, then the other, then runs the mode the rule picks at
      each phase's end, and measures the other mode again once the chosen one has run
      ``backoff / EXPLORE_SHARE`` times the other's last phase, its first step included (~3%
      of the time at first). Each re-timing that confirms the choice doubles ``backoff``, up
      to ``MAX_BACKOFF`` (~0.4%: under a steady load a losing mode costs little for long); a
      re-timing that changes the choice, or a change of the rule's answer at the end of a
      phase of the chosen mode (the acceptance moved), sets it back to 1. A level where
      speculation could not pay even if every draft were accepted (``(1 + k) t_off < t_on``,
      "hopeless") is re-timed only at the longest interval, and so is a level next to one
      (the nearest measured level below, else above): after its first phase off it does not
      time speculation (it takes the hopeless level's ratio of the two modes) until a
      re-timing at that interval - suffix decoding's first speculating step after a paused
      stretch catches up on every request's tokens of that stretch, a cost that grows with
      the running requests (e.g. at 128-255 running next to a hopeless 256; the
      speculative-decoding benchmarks, benchmarks/README.md, measure it).
    - Stretches and switches: a phase is steps of one stretch of load (a jump of the load or
      an idle engine ends it, ``scheduled``); a level beginning a stretch follows its
      nearest measured level or runs its one timed mode (``speculate``); at each phase's
      start the rule is applied with the acceptance of now, the other mode winning against
      the chosen one only by ``MARGIN``, and a switch to speculation must win back its
      catch-up within ``SWITCH_STEPS`` (``_choose``).

    Example: at 32 running, t_on 80 ms and t_off 50 ms: speculation needs a > 0.6; at 1
    running, 30 and 20 ms: a > 0.5.
    """

    PHASE = 8
    SWITCH_STEPS = 4 * PHASE  # the steps a switch to speculation has to pay for itself
    MARGIN = 0.05  # the other mode wins against a level's chosen one by this share
    EXPLORE_SHARE = 1 / 32
    MAX_BACKOFF = 8
    SHADOWED = 2  # requests followed by shadow drafts at once (host time: ~1.5 proposals a step)
    EMA = 0.5  # per phase, for step times
    ACC_EMA = 1 / 16  # per step (its opportunities' mean), for the acceptance: ~2 phases
    PROMPT_EMA = 1 / 16  # per step with prompt tokens, for a prompt token's cost
    DECODE_EMA = 1 / 4  # per decode-only step, for the average a prompt step is set against

    def __init__(self, shadow: bool = True, max_accepted: int | None = None) -> None:
        self.buckets: dict[int, _Bucket] = {}
        # k: the most drafts a step can accept (None: no level is taken as hopeless)
        self.max_accepted = max_accepted
        self.samples = 0  # drafting opportunities seen
        # a: drafts accepted per drafting opportunity, an average over steps; the current
        # step's opportunities are summed until its update folds them in
        self._acc = 0.0
        self._folds = 0
        self._pending_sum = 0.0
        self._pending_n = 0
        self.shadow_drafts = shadow  # the proposer can draft on the host while paused
        # the requests followed while paused -> their pending shadow drafts (None: none)
        self._shadow: dict[str, tuple[int, list[int]] | None] = {}
        # step id -> (its scheduling's start, running requests, speculated, prompt tokens,
        # a burst of arrivals: not timed, the load moved in one go: not timed, and it ends
        # the phases in progress)
        self._steps: dict[int, tuple[float, int, bool, int, bool, bool]] = {}
        self._last_running: int | None = None  # the last scheduled step's load
        # bumped when the engine goes idle or the load moves in one go: a phase is steps of
        # one epoch (a partial phase left by an earlier stretch at its level starts over)
        self._epoch = 0
        self._last_update: float | None = None  # None: the engine was idle since
        self.paused_now = False  # the last scheduled step proposed nothing
        self.not_timed_s = 0.0  # host time since the last update that no step is charged
        self._last_mode: bool | None = None  # the mode of the last step that came back
        # a prompt token's cost: averages of a prompt step's time beyond its level and mode's
        # decode-only step and of its prompt tokens (prompt_token_s = their ratio)
        self._prompt_extra_s = 0.0
        self._prompt_tokens = 0.0
        self.not_timed_total_s = 0.0  # the proposer's work for ending requests, all told
        # benchmarks set a list: each update appends (running, speculated, its time or None
        # where not counted, prompt tokens), each phase's end ("phase", running, mode, median
        # s, the acceptance then)
        self.trace: list[tuple] | None = None

    def _bucket(self, num_running: int) -> _Bucket:
        key = max(num_running, 1).bit_length()
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket(mode=self._neighbour_choice(key))
        return b

    def _neighbour_choice(self, key: int) -> bool:
        """A new load level starts in the mode the rule picks at the nearest level with both
        modes measured (the larger load on a tie), on where there is none: its first phase
        then costs little where the neighbour is right (the other mode is measured next).

        Example: levels 256-511 measured off, 1 measured on: a first step at 128 running
        starts off; at 2, on."""
        measured = [k for k, b in self.buckets.items() if len(b.step_s) == 2]
        if not measured:
            return True
        near = min(measured, key=lambda k: (abs(k - key), -k))
        return self._pays(self.buckets[near])

    def _pays(self, b: _Bucket, chosen: bool | None = None) -> bool:
        """The rule, ``(1 + a) * t_off > t_on``; against a level's ``chosen`` mode the other
        has to win by ``MARGIN`` (a level near the edge keeps its mode instead of switching
        with each phase's noise: a switch costs steps of its own - the first plain step
        after speculating ones, the first speculating one after plain ones - that the rule
        does not see).

        Example: t_on 3 ms and t_off 1.5 ms put the edge at a = 1.0; with the acceptance
        moving 0.9-1.1 about it, a rule without the margin would switch every few phases
        and pay those steps each time."""
        gain = (1.0 + self.accepted) * b.step_s[False]  # (no division: a time may be 0)
        if chosen is None:
            return gain > b.step_s[True]
        return gain > (1.0 - self.MARGIN if chosen else 1.0 + self.MARGIN) * b.step_s[True]

    def _hopeless(self, b: _Bucket) -> bool:
        """Whether speculation could not pay at this level even if every draft were
        accepted: ``(1 + k) * t_off < t_on``."""
        k = self.max_accepted
        return k is not None and len(b.step_s) == 2 and (1 + k) * b.step_s[False] < b.step_s[True]

    def _hopeless_near(self, key: int) -> _Bucket | None:
        """The nearest measured level below, else above, where speculation is hopeless, if
        one is: then it is taken to be at this load too. Below, because a speculating step's
        cost relative to a plain one grows with the load (the verification's k + 1 tokens a
        request move from riding on the weights' read towards the compute's bound, and the
        proposers' host work grows with the requests); above, because timing it there costs
        more than it can win: a level next to a hopeless one sees the load a few requests
        away from it (255 next to 256), and a suffix decoding that speculates there first
        catches up on every request's tokens of the paused stretch.

        Example: levels 4 (speculation pays) and 256 (hopeless) measured: for 128, 256 (4,
        below, is not hopeless); for 2, none (4, above, is not)."""
        measured = [k for k, b in self.buckets.items() if k != key and len(b.step_s) == 2]
        below = max((k for k in measured if k < key), default=None)
        above = min((k for k in measured if k > key), default=None)
        for k in (below, above):
            if k is not None and self._hopeless(self.buckets[k]):
                return self.buckets[k]
        return None

    def speculate(self, num_running: int) -> bool:
        """Whether a step at this load proposes drafts (the current phase's mode). A level
        with nothing timed yet and no phase in progress (one begun in an earlier stretch is
        dropped at the next step) follows its nearest measured level as that one's choice
        changes (a level the load only passes through - the steps where a whole batch
        arrives at once - is never timed, and would keep the guess it was made with; one
        that gets a single step at each batch's end kept the guess of the first batch).
        A measured level applies the rule again at each phase's start with the acceptance of
        now (a level the load visits a step at a time - 255 running at the end of each batch
        of 256 - completes no phase, and kept a choice made batches before)."""
        b = self._bucket(num_running)
        key = max(num_running, 1).bit_length()
        # the level's first step since the load came back: another stretch began since its
        # last step, or begins with this one (the engine was idle, or the load jumps)
        last = self._last_running
        stretch = (
            b.epoch != self._epoch
            or self._last_update is None
            or (last is not None and self._moved(last, num_running))
        )
        if stretch and b.exploring and b.steps:
            self._give_up_retiming(b)
        start = b.steps == 0 or stretch  # no phase in progress
        if not b.step_s and start:
            b.mode = self._neighbour_choice(key)
        elif len(b.step_s) == 1 and stretch:
            # a level with one mode timed begins a stretch in that mode, and times the other
            # after a phase of it: one visited a step at a time (255 running at the end of
            # each batch of 256) would otherwise wait in the mode to time next, batch after
            # batch, and with suffix decoding pay the trees' catch-up at each speculating step
            if list(b.step_s) == [False] and self._assume_hopeless(b, key):
                b.mode = False  # or it takes the ratio of a hopeless level next to it
            else:
                b.mode = next(iter(b.step_s))
        elif len(b.step_s) == 2 and start and not b.exploring:
            best = self._choose(b, b.mode, b.mode)
            if best != b.mode:
                b.mode, b.since_explore_s = best, 0.0
                b.backoff = self.MAX_BACKOFF if self._hopeless(b) else 1
        return b.mode

    @staticmethod
    def _give_up_retiming(b: _Bucket) -> None:
        """A re-timing cut short by the end of a stretch is given up until the next interval:
        the level goes back to its chosen mode and drops the partial phase (carried into the
        next stretch, it would time suffix decoding on a fresh batch, whose speculating steps
        are the cheapest, after a catch-up of every request's tokens)."""
        b.exploring, b.mode, b.since_explore_s = False, not b.mode, 0.0
        b.steps, b.times = 0, []

    @staticmethod
    def _moved(last: int, num_running: int) -> bool:
        """Whether the load jumped between two steps (see ``scheduled``)."""
        return abs(num_running - last) > max(4, last // 8)

    def _choose(self, b: _Bucket, mode: bool, chosen: bool | None) -> bool:
        """The rule's mode for a level running ``mode`` whose ``chosen`` one (None: none yet)
        the other has to beat by ``MARGIN``; from plain steps, a switch to speculation must
        also pay for itself (``_switch_pays``)."""
        best = self._pays(b, chosen)
        if best and not mode and not self._switch_pays(b):
            return False
        return best

    def _assume_hopeless(self, b: _Bucket, key: int) -> bool:
        """For a level with only plain steps timed: if a level next to it is hopeless
        (``_hopeless_near``), speculating here is taken to cost what it costs there, relative
        to a plain step, and is first timed as a re-timing at the longest interval.

        Example: hopeless at 64 (30 ms against 4); off at 256 measured 6 ms -> on 45 ms."""
        near = self._hopeless_near(key)
        if near is None or near.step_s[False] <= 0.0:  # (no ratio to take from 0 s)
            return False
        scale = b.step_s[False] / near.step_s[False]
        b.step_s[True] = near.step_s[True] * scale
        b.phase_cost_s[True] = near.phase_cost_s[True] * scale
        b.backoff = self.MAX_BACKOFF
        return True

    def _switch_pays(self, b: _Bucket) -> bool:
        """Whether switching a level from plain steps to speculation wins back, within
        ``SWITCH_STEPS`` speculating steps, what a first speculating step cost beyond the
        others lately (``switch_s``, the largest recent one: suffix decoding's catch-up on
        the tokens of the paused stretch, which grows with the running requests and can
        dwarf what a speculating step wins). Asked when the acceptance moved the rule's
        answer to speculation, not after a re-timing of plain steps (a short pause: little to
        catch up on).

        Example: a catch-up of 300 ms against a gain of 2 ms a step: 32 steps win back 64 ms,
        so the level stays plain."""
        gain_s = (1.0 + self.accepted) * b.step_s[False] - b.step_s[True]
        return gain_s * self.SWITCH_STEPS >= b.switch_s

    @property
    def accepted(self) -> float:
        """a: drafts accepted per drafting opportunity, an exponential average over steps of
        each step's mean (the opportunities since the last update count as one step). Per
        step, not per opportunity: at 16 running a weight of 1 / 32 per opportunity would
        make this the last two steps' acceptance, and the rule would flip with each step's
        luck."""
        if not self._pending_n:
            return self._acc
        w = max(self.ACC_EMA, 1.0 / (self._folds + 1))  # a plain mean over the first steps
        return self._acc + w * (self._pending_sum / self._pending_n - self._acc)

    def sample(self, accepted: int) -> None:
        """One drafting opportunity's outcome: ``accepted`` drafts (0 when there were none)."""
        self._pending_sum += accepted
        self._pending_n += 1
        self.samples += 1

    def _fold(self) -> None:
        """The opportunities since the last update become one step of the average."""
        if self._pending_n:
            self._acc = self.accepted
            self._folds += 1
            self._pending_sum, self._pending_n = 0.0, 0

    def shadow(
        self,
        req_id: str,
        tokens: Sequence[int],
        finished: bool,
        propose: Callable[[], list[int]],
    ) -> None:
        """While paused, after a request's tokens grew: settle its pending shadow drafts once
        the tokens that followed them decide them (a mismatch, all of them matched, or the
        request finished), then draft again with ``propose()`` (the drafts, [] for none) from
        its tokens now.

        Only ``SHADOWED`` requests are followed at once (others are ignored until one of them
        ends or speculation resumes): at 256 running the host drafts for a few requests a
        step, not for all, and a followed request's proposer state stays a few tokens behind
        (suffix decoding's tree of a request ingests its tokens at its next proposal). A
        shadow settles after the tokens a verification would have given (the accepted drafts
        and one more), so opportunities come as often as they would while speculating.

        Example: drafts [4, 5, 9] after 3 tokens; tokens 4, 5 arrive: undecided; 6 arrives:
        2 accepted."""
        if req_id in self._shadow:
            pending = self._shadow[req_id]
        elif finished or len(self._shadow) >= self.SHADOWED:
            return
        else:
            pending = None
        if pending is not None:
            n0, drafts = pending
            have = tokens[n0 : n0 + len(drafts)]
            a = 0
            while a < len(have) and have[a] == drafts[a]:
                a += 1
            if a == len(have) < len(drafts) and not finished:
                return  # every token so far matched, more drafts to check
            self.sample(a)
        if finished:
            self._shadow.pop(req_id, None)
            return
        drafts = propose()
        self._shadow[req_id] = (len(tokens), list(drafts)) if drafts else None
        if not drafts:
            self.sample(0)

    def summary(self) -> dict:
        """Per load level (its lowest running count): ms a step in each mode, the mode now,
        and the steps scheduled in each mode; the measured acceptance, and the learned cost of
        a prompt token."""
        cost = self.prompt_token_s
        return {
            "accepted_per_opportunity": self.accepted,
            "prompt_token_ms": None if cost is None else 1e3 * cost,
            "levels": {
                1 << (k - 1): {
                    "on_ms": 1e3 * b.step_s[True] if True in b.step_s else None,
                    "off_ms": 1e3 * b.step_s[False] if False in b.step_s else None,
                    "speculating": b.mode,
                    "steps_on": b.scheduled[True],
                    "steps_off": b.scheduled[False],
                    "retime_backoff": b.backoff,
                }
                for k, b in sorted(self.buckets.items())
            },
        }

    @property
    def followed(self) -> dict:
        """The requests shadow drafts follow (a live mapping: ``in`` tests membership)."""
        return self._shadow

    def has_room(self) -> bool:
        """Whether shadow drafts can follow another request."""
        return len(self._shadow) < self.SHADOWED

    def follows(self, req_id: str) -> bool:
        """Whether shadow drafts follow the request (its proposer state is current)."""
        return req_id in self._shadow

    def shadow_due(self, req_id: str) -> bool:
        """Whether ``shadow`` has work for the request: it is followed, or there is room to
        follow it (a cheap test for the many requests of a step under load)."""
        return req_id in self._shadow or len(self._shadow) < self.SHADOWED

    def forget(self, req_id: str) -> None:
        """The request ended or speculates again: its shadow drafts are dropped."""
        self._shadow.pop(req_id, None)

    @property
    def prompt_token_s(self) -> float | None:
        """Seconds a prompt token adds to a step (None until learned)."""
        return self._prompt_extra_s / self._prompt_tokens if self._prompt_tokens else None

    def scheduled(
        self,
        step_id: int,
        now: float,
        num_running: int,
        speculated: bool,
        prompt_tokens: int,
        arrivals: int = 0,
    ) -> None:
        """A step was scheduled (``now``: when its scheduling began) with this load and mode;
        ``prompt_tokens``: its tokens other than the decode rows' (their token and drafts);
        ``arrivals``: the requests it admits. A step that admits a burst (more than
        ``max(2, num_running // 16)``: a whole offline batch arriving at once) is not timed:
        admitting a request costs host work of its own, which the learned cost per prompt
        token does not hold (the pacer traces of the speculative-decoding benchmarks,
        benchmarks/README.md, show such steps well above their level's plain step plus their
        tokens' learned cost), and such steps come in a row through levels the load then
        leaves.

        Nor is a step whose load moved in one go from the last step's (by more than
        ``max(4, last // 8)`` requests): a batch that ends together leaves 256 -> 192 -> 129
        -> 66 running, one step at each, as requests admitted in one step end in one; such a
        step also ends the phases in progress (the next steps at a level are another stretch
        of it). A level the load only passes through is then never timed and follows its
        neighbour (``speculate``); timed, it would get a step or two a batch, and a phase in
        the mode it was guessed built of ramps and tails (a ramp step's admissions, a tail
        step's catch-up of suffix decoding's trees for every request), none of them the
        level's steady cost."""
        if len(self._steps) > 64:  # steps that never came back (a failed step)
            self._steps.pop(next(iter(self._steps)))
        burst = arrivals > max(2, num_running // 16)
        last, self._last_running = self._last_running, num_running
        moved = last is not None and self._moved(last, num_running)
        self._steps[step_id] = (now, num_running, speculated, prompt_tokens, burst, moved)
        self._bucket(num_running).scheduled[speculated] += 1
        self.paused_now = not speculated

    def updated(self, step_id: int, now: float, busy: bool) -> None:
        """The step's results reached the host at ``now``; ``busy``: requests are left.

        Its time: from the last update to now (the engine loop's host work between two
        updates belongs to the step after it, synchronous or not; asynchronous steps overlap,
        and one update follows another by a step's time). After an update that left no work
        (``busy`` False there), the next step's time starts at its scheduling instead. The
        proposer's work for requests that ended (``not_timed_s``: suffix decoding adds each
        output to its global tree) is taken out: all the requests of a batch run without
        drafts end in the same step, and their outputs joining the tree at once would make
        that one step as long as several of the phase's others. It is dearer while
        speculating (paused, only the followed requests' outputs join the tree) and charged
        to neither mode (the speculative-decoding benchmarks report it per run:
        ``not_timed_total_s``, benchmarks/README.md).

        Example, synchronous steps: an update at 10.000, output processing until 10.001,
        scheduling and drafting until 10.004, the step's update at 10.012: 12 ms (timing from
        the end of its scheduling would leave the drafting out: 8 ms).
        """
        self._fold()
        info = self._steps.pop(step_id, None)
        if self._last_update is None:  # the engine was idle: another stretch begins
            self._epoch += 1
        last, self._last_update = self._last_update, now if busy else None
        not_timed, self.not_timed_s = self.not_timed_s, 0.0
        self.not_timed_total_s += not_timed
        if info is None:
            return
        t_sched, num_running, speculated, prompt_tokens, burst, moved = info
        if moved:
            self._epoch += 1
        b = self._bucket(num_running)
        previous, self._last_mode = self._last_mode, speculated
        step_s = now - (last if last is not None else t_sched) - not_timed
        counted = speculated == b.mode and not burst and not moved
        if self.trace is not None:
            self.trace.append((num_running, speculated, step_s if counted else None, prompt_tokens))
        if not counted:
            return
        # the first step after a switch carries it (suffix decoding catching up: many steps),
        # whether the level switched or the load came from a level in the other mode: no
        # sample for the decode-only average nor for a prompt token's cost
        settled = previous == speculated
        if not prompt_tokens:
            if settled:
                old = b.decode_s.get(speculated)
                b.decode_s[speculated] = (
                    step_s if old is None else old + self.DECODE_EMA * (step_s - old)
                )
        else:
            cost = self.prompt_token_s
            known = b.decode_s.get(speculated)
            if known is not None and settled:  # learn what a prompt token costs
                w = self.PROMPT_EMA
                self._prompt_extra_s += w * (max(step_s - known, 0.0) - self._prompt_extra_s)
                self._prompt_tokens += w * (prompt_tokens - self._prompt_tokens)
            if cost is None:
                return
            step_s = max(step_s - cost * prompt_tokens, 0.0)
        if b.epoch != self._epoch:  # a partial phase of an earlier stretch starts over
            b.epoch, b.steps, b.times = self._epoch, 0, []
            if b.exploring:  # a re-timing cut short (``speculate`` gives it up first)
                self._give_up_retiming(b)
                return
        b.steps += 1
        if b.steps == 1:  # the phase's first step carries the switch
            b.first_s = step_s
        else:
            b.times.append(step_s)
        if b.steps < self.PHASE:
            return
        mode, phase_s = b.mode, sum(b.times)  # the PHASE - 1 steps after the first
        b.phase_cost_s[mode] = b.first_s + phase_s
        # the median of the PHASE - 1 steps: one stall (a garbage collection of the whole
        # heap; e.g. 200 ms among 4 ms steps makes the mean of 7 steps 32 ms, 8x) would make
        # the rule speculate where it loses (a stall in a plain phase inflates t_off); a
        # mode's cost is in every one of its steps
        x = statistics.median(b.times)
        old = b.step_s.get(mode)
        b.step_s[mode] = x if old is None else self.EMA * x + (1 - self.EMA) * old
        b.steps, b.times = 0, []
        if mode:
            # the largest of the recent ones, halved at each speculating phase: a switch
            # whose catch-up fell in a step not timed (the ramp of a batch) measures ~0
            b.switch_s = max(b.first_s - x, b.switch_s / 2)
        if self.trace is not None:
            self.trace.append(("phase", num_running, mode, x, self.accepted))
        key = max(num_running, 1).bit_length()
        if len(b.step_s) < 2:  # then the mode not measured yet, unless hopeless nearby
            if mode or not self._assume_hopeless(b, key):
                b.mode = True not in b.step_s
                return
        # the mode chosen before this phase (a re-timing times the other one)
        chosen = (not mode if b.exploring else mode) if b.decided else None
        b.decided = True
        if b.exploring:  # a re-timing phase of the mode not chosen ended
            best = self._pays(b, chosen)
            b.exploring = False
            b.backoff = min(2 * b.backoff, self.MAX_BACKOFF) if mode != best else 1
        else:  # the first choice, or the rule's answer moved with the acceptance
            best = self._choose(b, mode, chosen)
            if mode != best:
                b.backoff = 1
        if self._hopeless(b):  # re-timed only at the longest interval
            b.backoff = self.MAX_BACKOFF
        if mode != best:  # the other mode was just measured again (or the rule changed)
            b.since_explore_s = 0.0
            b.mode = best
            return
        b.since_explore_s += phase_s
        # the other mode's last phase, its first step included: switching to speculation
        # makes the proposer catch up on the tokens of the paused stretch (suffix decoding's
        # trees), a cost that grows with the stretch
        if b.since_explore_s * self.EXPLORE_SHARE >= b.phase_cost_s[not best] * b.backoff:
            b.mode = not best
            b.exploring = True
            b.since_explore_s = 0.0  # (else a rule that flips after the exploring phase
            # would switch back at once, and the two modes alternate phase by phase)


class SpecDecoding:
    """Drafts for the scheduler, acceptance of a step's samples, and the counters behind
    vLLM's ``vllm:spec_decode_*`` metrics."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.proposer = make_proposer(config)
        # a draft model runs in the model runner after each step: it needs lookahead slots
        # for the KVs of its own drafts, and its proposals come back with the step's output
        self.uses_runner = config.method == "draft_model"
        # ngram_gpu: the runner drafts on the device; the scheduler plans placeholders
        # (``drafts_for``) and may plan a request's next step before its drafts are verified
        self.device = config.method == "ngram_gpu"
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.disable_by_batch_size = config.disable_by_batch_size
        self.pacer = (
            SpecPacer(shadow=not self.uses_runner, max_accepted=self.k)
            if config.disable_when_slower
            else None
        )
        self.num_drafts = 0  # steps in which a request verified drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k  # drafts accepted at position j

    def paused(self, num_running: int, num_waiting: int = 0) -> bool:
        """Whether steps propose nothing at this load (``disable_by_batch_size``, or the
        pacer's measurements with ``disable_when_slower``). The pacer also pauses while more
        than ``max(2, num_running // 16)`` requests wait for a free seat (``num_waiting``: a
        burst is being admitted - an offline batch, whose steps pass through levels that are
        never timed, see ``SpecPacer.scheduled`` - or KV memory holds them back, where draft
        tokens would take token budget and slots from the requests waiting for their
        first)."""
        limit = self.disable_by_batch_size
        if limit is not None and num_running >= limit:
            return True
        pacer = self.pacer
        if pacer is None:
            return False
        return num_waiting > max(2, num_running // 16) or not pacer.speculate(num_running)

    def drafts_for(self, request: Request, budget: int) -> list[int]:
        """Draft tokens for a request about to decode one token (its last known token is on
        the host), within the step's remaining token ``budget`` and so that the request's
        ``max_tokens`` and ``max_model_len`` are never passed; [] for none."""
        if self.device:
            return self._device_placeholders(request, budget)
        return self._host_drafts(request, budget)

    def _host_drafts(self, request: Request, budget: int) -> list[int]:
        """The host proposer's drafts (``drafts_for``; the pacer's shadow drafts)."""
        if request.beam_group is not None:
            return []
        # Example: max_tokens 10, 7 output tokens -> at most 3 new tokens: the sample after
        # the known tokens and 2 drafts (each accepted draft is an output token)
        k = min(
            self.k,
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        if k < 1:
            return []
        tokens = request.all_token_ids
        return self.proposer.propose(request.request_id, tokens, request.num_prompt_tokens, k)

    def _device_placeholders(self, request: Request, budget: int) -> list[int]:
        """ngram_gpu: k placeholders (0) for the drafts the runner reads from its device
        lookup, or [] for a request whose sampling needs its drafts or positions on the host.

        Under async scheduling the host does not know the request's newest tokens (nor how
        many there are) when it plans the step, so only a request whose sampling depends on
        neither drafts: no penalties or multi-token bad words (they read the drafts as
        output), no seed (seeded samples are drawn by output position), no grammar (its
        bitmask covers each draft), no min_tokens still to reach (EOS is masked by output
        position), no beams or parallel sequences. The positions are bounded as if every
        unverified draft were accepted (``num_computed_tokens`` counts them): e.g. max_model_len
        100, 90 computed -> at most 9 (the last draft at position 99). As many as the lookup
        after the request's last resolved step found (a row without a match verifies no
        placeholders: under load they cost compute for nothing); k before any."""
        p = request.sampling_params
        if (
            request.beam_group is not None
            or request.parent_id is not None
            or request.needs_host_tokens
            or request.grammar_key is not None
            or p.seed is not None
            or request.num_output_tokens < p.min_tokens
        ):
            return []
        found = request.device_drafts_found
        k = min(
            self.k if found is None else found,
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - 1 - request.num_computed_tokens,
        )
        return [0] * k if k >= 1 else []

    def step_lookahead(
        self, request: Request, num_new: int, num_drafts: int, num_computed: int | None = None
    ) -> int:
        """Lookahead slots for the drafts a draft model writes after this step, when the
        request's step (``num_new`` known tokens from ``num_computed`` on, then
        ``num_drafts`` drafts to verify) ends with a sample; 0 otherwise.

        Example: 40 known tokens, 39 computed, 1 new + 3 drafts -> positions up to 42 are
        computed in the step -> slots for k more from position 43 on (the new token after the
        accepted drafts is at most at 43: the draft model's KVs go from there)."""
        if not self.uses_runner:
            return 0
        computed = request.num_computed_tokens if num_computed is None else num_computed
        if computed + num_new != request.num_tokens + request.num_output_placeholders:
            return 0  # a prefill chunk before the prompt's end: nothing to draft after
        return self.lookahead(request, computed + num_new + num_drafts)

    def scheduled(
        self, out: Any, t_start: float, load: int, speculate: bool, arrivals: int
    ) -> None:
        """Tell the pacer (if any) about a scheduled step ``out`` (a SchedulerOutput): its
        prompt tokens are the rows longer than a decode row (its token and its drafts: prompt
        chunks, or a preempted request's recompute); none where the step is as long as its
        decode rows (no Python pass over 256 rows then)."""
        if self.pacer is None:
            return
        num_scheduled, spec_tokens = out.num_scheduled_tokens, out.scheduled_spec_tokens
        prompt_tokens = 0
        decode_len = len(num_scheduled) + sum(map(len, spec_tokens.values()))
        if out.total_num_scheduled_tokens != decode_len:
            prompt_tokens = sum(
                n for rid, n in num_scheduled.items() if n > 1 + len(spec_tokens.get(rid, ()))
            )
        self.pacer.scheduled(out.step_id, t_start, load, speculate, prompt_tokens, arrivals)

    def lookahead(self, request: Request, num_computed_after: int) -> int:
        """Lookahead slots for a request whose step ends with a sample, so that the draft
        model can write the KVs of its k drafts after the step (0 without a draft model, for a
        request that forks n sequences or beams (a forked table shares every block, and only
        the block a step writes first is copied on write), or at the end of the context).

        Example: k 4, max_model_len 100, 90 tokens computed after the step -> 4 slots; 97 ->
        2 (the draft writes at most up to position max_model_len - 2)."""
        if not self.uses_runner or request.beam_group is not None:
            return 0
        if request.num_output_tokens == 0 and request.sampling_params.num_sequences > 1:
            return 0  # its first sample forks the sequences
        return max(0, min(self.k, self.max_model_len - 1 - num_computed_after))

    def store(self, req_id: str, num_tokens: int, drafts: list[int]) -> None:
        """Keep the drafts the runner's draft model proposed after a request's first
        ``num_tokens`` tokens, for its next step."""
        self.proposer.store(req_id, num_tokens, drafts)  # type: ignore[attr-defined]

    def accept(self, drafts: list[int], samples: list[int]) -> int:
        """The number of drafts accepted: the longest prefix of ``drafts`` equal to the
        samples at the same positions. Example: drafts [5, 9, 2], samples [5, 9, 7, 4] -> 2
        (the new tokens are then 5, 9, 7)."""
        a = 0
        while a < len(drafts) and a < len(samples) and samples[a] == drafts[a]:
            a += 1
        if drafts:  # (a device lookup that found nothing verified no draft: not counted)
            self.num_drafts += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += a
        if self.pacer is not None:
            self.pacer.sample(a)
        for j in range(a):
            self.accepted_per_pos[j] += 1
        return a

    def observe(self, request: Request, paused: bool, drafted: bool) -> None:
        """After a request decoded in a step (``disable_when_slower``): a speculating step's
        request without drafts counts as an opportunity with none accepted; a paused step's
        request checks and renews its shadow drafts."""
        pacer = self.pacer
        if pacer is None or request.beam_group is not None:  # beams never draft
            return
        if not paused:
            pacer.forget(request.request_id)
            if not drafted:
                pacer.sample(0)
        elif pacer.shadow_drafts and pacer.shadow_due(request.request_id):
            pacer.shadow(
                request.request_id,
                request.all_token_ids,
                request.is_finished,
                lambda: self._host_drafts(request, self.k + 1),
            )

    def finish(self, request: Request) -> None:
        """The request ended: the proposer drops (or, suffix decoding, keeps) what it knew.

        While the pacer has speculation paused, only the requests its shadow drafts follow
        pass their output on (suffix decoding's global tree learns from those, not from every
        request: its Python tree costs host time per output token, which at 256 running is a
        share of a step's time); the others end as if they had no output."""
        rid, tokens, n = request.request_id, request.all_token_ids, request.num_prompt_tokens
        pacer = self.pacer
        if pacer is None:
            self.proposer.finish(rid, tokens, n)
            return
        if pacer.paused_now and not pacer.follows(rid):
            tokens = tokens[:n]  # nothing to learn from
        pacer.forget(rid)
        t = time.perf_counter()
        self.proposer.finish(rid, tokens, n)
        pacer.not_timed_s += time.perf_counter() - t

    def stats(self) -> dict[str, float | list[int]]:
        """Counters for metrics and the offline API's stats."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
        }

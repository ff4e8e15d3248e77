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

from dataclasses import dataclass, field

from pagedllm.core.request import Request
from pagedllm.spec_decode import SpeculativeConfig, make_proposer


@dataclass
class _Bucket:
    """A load level's measurements: each mode's output tokens per second and seconds a phase
    (exponential averages), and the time spent in the faster mode since the other was tried."""

    rate: dict[bool, float] = field(default_factory=dict)  # speculating -> tokens / s
    phase_s: dict[bool, float] = field(default_factory=dict)  # speculating -> s a phase
    mode: bool = True  # the current phase's
    steps: int = 0  # steps of the current phase seen (the first is not counted)
    tokens: int = 0
    seconds: float = 0.0
    since_explore_s: float = 0.0


class SpecPacer:
    """Turns speculation off at the loads where it is slower (``disable_when_slower``).

    Per load level (bucket: the number of running requests rounded down to a power of two)
    it measures output tokens per second of decode-only steps in phases of ``PHASE`` steps,
    each phase with speculation on or off, and keeps an exponential average per mode. A
    level tries both modes first (on, then off), then runs the faster one, and tries the
    other again (the acceptance and the load drift) once the time spent in the faster mode
    since the last try is ``1 / EXPLORE_SHARE`` times the other mode's phase: at most ~3% of
    the time goes to the slower mode, however much slower it is. A phase's first step is not
    counted (the switch between synchronous and asynchronous steps), nor are steps with
    prompt tokens (their cost is not the mode's), nor the engine's idle time.

    Example: at 32 running, phases measured 900 tok/s with drafts (0.4 s a phase) and 1,150
    without: that level runs without drafts and tries them again after 0.4 x 32 = 12.8 s; at
    1 running, 120 with and 60 without: drafts.
    """

    PHASE = 8
    EXPLORE_SHARE = 1 / 32
    EMA = 0.5

    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}
        self._steps: dict[int, tuple[float, int, bool, bool]] = {}
        self._last_update: float | None = None

    def _bucket(self, num_running: int) -> _Bucket:
        return self.buckets.setdefault(max(num_running, 1).bit_length(), _Bucket())

    def speculate(self, num_running: int) -> bool:
        """Whether a step at this load proposes drafts (the current phase's mode)."""
        return self._bucket(num_running).mode

    def scheduled(
        self, step_id: int, now: float, num_running: int, speculated: bool, decode_only: bool
    ) -> None:
        """A step was scheduled at ``now`` with this load and mode."""
        if len(self._steps) > 64:  # steps that never came back (a failed step)
            self._steps.pop(next(iter(self._steps)))
        self._steps[step_id] = (now, num_running, speculated, decode_only)

    def updated(self, step_id: int, now: float, num_tokens: int) -> None:
        """The step's results reached the host at ``now`` with ``num_tokens`` output tokens.

        Its time: from the later of the last update and its own scheduling (steps in flight
        overlap; after an idle engine the first step starts when it was scheduled) to now.
        """
        info = self._steps.pop(step_id, None)
        last, self._last_update = self._last_update, now
        if info is None:
            return
        t_sched, num_running, speculated, decode_only = info
        b = self._bucket(num_running)
        if not decode_only or speculated != b.mode:
            return
        b.steps += 1
        if b.steps > 1:  # the phase's first step carries the switch
            b.tokens += num_tokens
            b.seconds += now - max(t_sched, last if last is not None else t_sched)
        if b.steps < self.PHASE:
            return
        if b.seconds > 0:
            for avg, x in ((b.rate, b.tokens / b.seconds), (b.phase_s, b.seconds)):
                old = avg.get(b.mode)
                avg[b.mode] = x if old is None else self.EMA * x + (1 - self.EMA) * old
        b.steps, b.tokens, phase_s, b.seconds = 0, 0, b.seconds, 0.0
        if len(b.rate) < 2:  # measure on first, then off
            b.mode = True not in b.rate
            return
        best = b.rate[True] >= b.rate[False]
        if b.mode != best:  # the other mode was just tried
            b.since_explore_s = 0.0
            b.mode = best
            return
        b.since_explore_s += phase_s
        if b.since_explore_s * self.EXPLORE_SHARE >= b.phase_s[not best]:
            b.mode = not best


class SpecDecoding:
    """Drafts for the scheduler, acceptance of a step's samples, and the counters behind
    vLLM's ``vllm:spec_decode_*`` metrics."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.proposer = make_proposer(config)
        # a draft model runs in the model runner after each step: it needs lookahead slots
        # for the KVs of its own drafts, and its proposals come back with the step's output
        self.uses_runner = config.method == "draft_model"
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.disable_by_batch_size = config.disable_by_batch_size
        self.pacer = SpecPacer() if config.disable_when_slower else None
        self.num_drafts = 0  # steps in which a request verified drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k  # drafts accepted at position j

    def paused(self, num_running: int) -> bool:
        """Whether steps propose nothing at this load (``disable_by_batch_size``, or the
        pacer's measurements with ``disable_when_slower``)."""
        limit = self.disable_by_batch_size
        if limit is not None and num_running >= limit:
            return True
        return self.pacer is not None and not self.pacer.speculate(num_running)

    def drafts_for(self, request: Request, budget: int) -> list[int]:
        """Draft tokens for a request about to decode one token (its last known token is on
        the host), within the step's remaining token ``budget`` and so that the request's
        ``max_tokens`` and ``max_model_len`` are never passed; [] for none."""
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
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += a
        for j in range(a):
            self.accepted_per_pos[j] += 1
        return a

    def finish(self, request: Request) -> None:
        """The request ended: the proposer drops (or, suffix decoding, keeps) what it knew."""
        self.proposer.finish(request.request_id, request.all_token_ids, request.num_prompt_tokens)

    def stats(self) -> dict[str, float | list[int]]:
        """Counters for metrics and the offline API's stats."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
        }

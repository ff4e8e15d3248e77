"""Beam search on shared paged blocks.

The search itself (``BeamSearchState``) is plain Python and follows HF transformers'
``generate(num_beams=k, do_sample=False)`` step by step: each step takes the best
``max(2, 1 + num_eos) x k`` continuations of the live beams by accumulated log-probability;
continuations that end (EOS, or the length limit) and rank in the first k become finished
hypotheses scored ``logprob_sum / generated_len ** length_penalty``; the best k others live on.
``early_stopping`` has HF's meanings (True, False, "never").

In the engine each live beam is a request. A step's choices become block-table operations:
a beam chosen once is extended in place; a beam chosen j > 1 times is forked j - 1 times
(``KVCacheManager.fork``: shared blocks, copy-on-write of the partial last block); a beam not
chosen is freed. No step ever copies a whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BeamSearchParams:
    """Parameters of ``LLM.beam_search`` (vLLM's names, plus HF's ``early_stopping``)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}.")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}.")
        if self.temperature != 0.0:
            raise ValueError("temperature must be 0 for beam search (beams are deterministic).")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}."
            )


@dataclass
class BeamSearchSequence:
    """One finished hypothesis: generated tokens, their log-probability sum and its score."""

    tokens: list[int]
    cum_logprob: float
    score: float
    text: str = ""
    finish_reason: str = "length"


@dataclass
class BeamSearchOutput:
    """The hypotheses of one prompt, best first."""

    sequences: list[BeamSearchSequence]
    prompt_token_ids: list[int] = field(default_factory=list)


@dataclass
class Beam:
    """A live beam: its engine request id, accumulated logprob and generated tokens."""

    request_id: str
    score: float
    tokens: list[int]


@dataclass
class Choice:
    """A continuation that lives on: extend (or fork) ``parent`` with ``token``."""

    parent: str
    token: int
    score: float


class BeamSearchState:
    """HF-equivalent beam bookkeeping for one prompt (see module docstring)."""

    def __init__(
        self,
        params: BeamSearchParams,
        prompt_len: int,
        eos_ids: set[int],
        first_request_id: str,
        max_new_tokens: int | None = None,
    ) -> None:
        self.k = params.beam_width
        self.params = params
        self.prompt_len = prompt_len
        limit = min(params.max_tokens, max_new_tokens or params.max_tokens)
        self.max_length = prompt_len + limit  # capped by max_model_len and the cache size
        self.eos_ids = set() if params.ignore_eos else set(eos_ids)
        self.cur_len = prompt_len
        self.beams = [Beam(first_request_id, 0.0, [])]
        self.finished: list[BeamSearchSequence] = []
        self.unsatisfied = True  # HF's is_early_stop_heuristic_unsatisfied
        self.done = False
        self.pending: dict[str, list[tuple[int, float]]] = {}

    @property
    def keep(self) -> int:
        return max(2, 1 + len(self.eos_ids)) * self.k

    def report(self, request_id: str, candidates: list[tuple[int, float]]) -> bool:
        """Record a live beam's top (token, logprob) pairs; True once every beam reported."""
        self.pending[request_id] = candidates
        return all(b.request_id in self.pending for b in self.beams)

    def step(self) -> list[Choice]:
        """Advance one token with every beam's reported candidates; returns the beams to
        continue (best first). Sets ``done`` when the search is over."""
        flat = []
        for b in self.beams:
            for tok, lp in self.pending[b.request_id]:
                flat.append((b.score + lp, b, tok))
        self.pending = {}
        flat.sort(key=lambda c: -c[0])
        top = flat[: self.keep]
        gen_len = self.cur_len + 1 - self.prompt_len
        hits = [tok in self.eos_ids or self.cur_len + 1 >= self.max_length for _, _, tok in top]
        running = [(s, b, t) for (s, b, t), h in zip(top, hits) if not h][: self.k]
        lp_norm = gen_len**self.params.length_penalty
        full = len(self.finished) >= self.k
        if self.unsatisfied and not (full and self.params.early_stopping is True):
            for (s, b, t), h in zip(top[: self.k], hits[: self.k]):
                if h:
                    reason = "length" if t not in self.eos_ids else "stop"
                    self.finished.append(
                        BeamSearchSequence(b.tokens + [t], s, s / lp_norm, finish_reason=reason)
                    )
            self.finished.sort(key=lambda x: -x.score)
            self.finished = self.finished[: self.k]
        self.cur_len += 1
        self._early_stop_heuristic(running[0][0] if running else None)
        all_done = len(self.finished) >= self.k and self.params.early_stopping is True
        self.done = (not self.unsatisfied) or all_done or all(hits) or not running
        choices = [Choice(b.request_id, t, s) for s, b, t in running]
        self.beams = [Beam("", s, b.tokens + [t]) for s, b, t in running]  # ids set by caller
        return [] if self.done else choices

    def _early_stop_heuristic(self, best_running: float | None) -> None:
        if best_running is None:
            return
        if self.params.early_stopping == "never" and self.params.length_penalty > 0.0:
            best_len = self.max_length - self.prompt_len
        else:
            best_len = self.cur_len - self.prompt_len
        best = best_running / best_len**self.params.length_penalty
        worst = min(x.score for x in self.finished) if len(self.finished) >= self.k else -1e9
        self.unsatisfied = self.unsatisfied and best > worst

    def results(self) -> list[BeamSearchSequence]:
        """Finished hypotheses, best first (the live beams count when none finished)."""
        if self.finished:
            return list(self.finished)
        return [BeamSearchSequence(b.tokens, b.score, b.score) for b in self.beams]

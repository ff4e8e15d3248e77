"""The scheduler's bookkeeping of structured-output (grammar) requests.

A request with ``structured_outputs`` waits (``WAITING_FOR_GRAMMAR``) while its grammar
compiles; once compiled it gets a *grammar key*, the name of its matcher in ``Grammars`` (the
matchers beside the engine loop, see ``structured_output/grammars.py``). From then on every
token it samples is accepted by that matcher (before or during ``update_from_output``), a fork
of parallel sampling forks the matcher, and the end of the request drops it. A token the
matcher rejects comes back a step later as an error for the request.

A reasoning model's request (``reasoning_end_token_id`` set) thinks before it answers: until it
samples that token (``</think>``) it gets no bitmask row and its tokens are not accepted, so
the grammar constrains the answer only (vLLM's rule). The end token itself is not accepted.
Where the output may not think at all (``reasoning_start_token_id``, ``<think>``: Qwen3), its
first token decides, sampled under the grammar's first mask plus the start token
(``OpenFill``): the start token opens the thinking; any other token is the answer's first,
accepted by the matcher in the update (the step's tokens are then not sent ahead).

``GrammarBook`` owns all of that state; the scheduler calls it at those points and keeps none
of it. It holds no queue: what to do with a request whose grammar failed (remove it from the
waiting queue, free it, report it) stays with the scheduler.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched.output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.structured_output.matchers import OpenFill, SpecFill

if TYPE_CHECKING:
    from pagedllm.structured_output.grammars import Grammars, GrammarStep


class GrammarBook:
    """Grammar keys, their live owners and the operations sent to ``Grammars``.

    ``structured`` (the ``StructuredOutputManager``: compiler and stop token ids) and
    ``grammars`` (the matchers) are set by the engine core on first use; while they are None
    no request has a grammar and every method is a no-op (or raises, for ``submit``).
    """

    def __init__(self) -> None:
        self.structured: Any = None  # StructuredOutputManager, set by the engine core
        self.grammars: Grammars | None = None  # the matchers of structured requests
        self._serial = itertools.count()
        self._owner: dict[int, Request] = {}  # grammar key -> its live request
        # this update's tokens went to Grammars already (``send_tokens``): do not accept again
        self._tokens_sent = False

    # ------------------------------------------------------------------ request lifetime
    def submit(self, request: Request) -> None:
        """Start compiling a new request's grammar; the request waits for it. ValueError when
        structured outputs are not available."""
        if self.structured is None:
            raise ValueError("structured outputs need a tokenizer and the xgrammar package.")
        request.grammar_future = self.structured.submit(request.sampling_params.structured_outputs)
        request.status = RequestStatus.WAITING_FOR_GRAMMAR

    def ready(self, waiting: Iterable[Request]) -> list[Request]:
        """Give each waiting request whose grammar compiled a matcher (it becomes WAITING);
        return those whose grammar failed, with ``request.error`` set, for the scheduler to end.
        (Nothing changes while the grammar worker process is still starting.)"""
        if self.grammars is None or not self.grammars.ready():
            return []
        failed: list[Request] = []
        for request in waiting:
            fut = request.grammar_future
            if request.status != RequestStatus.WAITING_FOR_GRAMMAR or not fut.done():
                continue
            err = fut.exception()
            if err is not None:
                request.error = str(err)
                failed.append(request)
                continue
            self._give_key(request)
            self.grammars.add(request.grammar_key, fut.result())
            request.status = RequestStatus.WAITING
        return failed

    def release(self, request: Request) -> None:
        """A request ends: drop its matcher (no-op without one)."""
        key = request.grammar_key
        if key is None:
            return
        assert self.grammars is not None
        self.grammars.drop(key)
        self._owner.pop(key, None)
        request.grammar_key = None

    def fork(self, parent: Request, child: Request) -> None:
        """Parallel sampling: ``child`` continues from ``parent``'s grammar state (call before
        the parent accepts its own token of the step)."""
        if parent.grammar_key is None:
            return
        assert self.grammars is not None
        self._give_key(child)
        self.grammars.fork(parent.grammar_key, child.grammar_key)

    def _give_key(self, request: Request) -> None:
        """A fresh grammar key for ``request`` (its matcher's name in ``Grammars``)."""
        request.grammar_key = next(self._serial)
        self._owner[request.grammar_key] = request

    # ---------------------------------------------------------------------------- steps
    def batch_keys(
        self,
        batch: list[Request],
        num_scheduled: Iterable[int],
        spec_tokens: dict[str, list[int]] | None = None,
    ) -> tuple[list[Any], list[int]]:
        """The grammar keys of the batch's structured requests that sample this step (their
        computed tokens reach their known ones) and their batch indices; a request verifying
        drafts (``spec_tokens``) is a ``SpecFill`` (a bitmask row per position). Costs nothing
        while no live request has a grammar."""
        keys: list[Any] = []
        idx: list[int] = []
        if not self._owner:
            return keys, idx
        spec_tokens = spec_tokens or {}
        for i, (r, n) in enumerate(zip(batch, num_scheduled)):
            if r.grammar_key is None or r.num_computed_tokens + n < r.num_tokens:
                continue
            if r.reasoning_end_token_id is not None:  # thinking (or about to choose)
                if r.reasoning_start_token_id is not None:  # the first token: answer or <think>
                    keys.append(OpenFill(r.grammar_key, r.reasoning_start_token_id))
                    idx.append(i)
                continue  # thinking: unconstrained
            drafts = spec_tokens.get(r.request_id)
            keys.append(SpecFill(r.grammar_key, tuple(drafts)) if drafts else r.grammar_key)
            idx.append(i)
        return keys, idx

    def send_tokens(self, so: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """Give the step's sampled tokens of structured requests to ``Grammars`` now, before
        the update (which then does not): see ``Scheduler.send_grammar_tokens``."""
        tokens = runner_output.structured_tokens
        if (
            runner_output.forked_token_ids
            or tokens is None
            or any(isinstance(key, (SpecFill, OpenFill)) for key in so.structured_requests)
        ):
            return  # the update orders the forks and the tokens (and accepts drafts)
        assert self.grammars is not None
        # (a key whose request ended meanwhile was dropped first: Grammars skips it)
        self.grammars.accept_many(so.structured_requests, tokens)
        self._tokens_sent = True

    def end_update(self) -> None:
        """The update is over: the next step's tokens have not been sent."""
        self._tokens_sent = False

    def accept(self, request: Request, token: int) -> bool:
        """Advance the request's grammar by ``token``; True when the grammar has terminated:
        the token is one of the tokenizer's stop tokens, which the bitmask allows only where
        the grammar may end (the request then finishes with reason 'stop'). A token the grammar
        rejects comes back from ``Grammars`` a step later (``apply_step``)."""
        if request.grammar_key is None or request.is_finished:
            return False
        sent = self._tokens_sent
        if request.reasoning_end_token_id is not None:  # thinking: the grammar waits
            opening, request.reasoning_start_token_id = request.reasoning_start_token_id, None
            if opening is None or token in (opening, request.reasoning_end_token_id):
                if token == request.reasoning_end_token_id:
                    request.reasoning_end_token_id = None
                return False
            request.reasoning_end_token_id = None  # no thinking: this token starts the answer
            sent = False  # (an OpenFill step sends no tokens ahead)
        if not sent:
            assert self.grammars is not None
            self.grammars.accept(request.grammar_key, token)
        if token in self.structured.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        return False

    def apply_step(
        self, step: GrammarStep, abort: Callable[[Request], None]
    ) -> list[EngineCoreOutput]:
        """End (``abort``) each live request whose token a grammar rejected, with an error
        output (a bitmask should never let one through: this is a safety net)."""
        outputs = []
        for key, message in step.rejected.items():
            request = self._owner.get(key)
            if request is None or request.is_finished:
                continue
            request.error = message
            abort(request)
            outputs.append(
                EngineCoreOutput(
                    request.request_id,
                    [],
                    finish_reason="abort",
                    error=message,
                    parent_id=request.parent_id,
                    seq_index=request.seq_index,
                )
            )
        return outputs

    def rollback(self, request: Request, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens of a request's matcher (rejected
        speculative tokens)."""
        if request.grammar_key is not None and num_tokens > 0:
            assert self.grammars is not None
            self.grammars.rollback(request.grammar_key, num_tokens)

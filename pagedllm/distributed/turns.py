"""Two threads taking turns at their collectives: the mechanism of dual-batch overlap
(``worker/ubatch.py`` runs a step's two micro-batches with it).

``run_overlapped(first, second)`` runs ``first`` and ``second`` in two threads, one at a time:
``first`` starts; a thread that has started an asynchronous collective calls
``yield_to_other()``, which hands the turn to the other thread and returns when the turn comes
back (or at once when the other has finished); then it waits for its transfer. Outside
``run_overlapped`` ``yield_to_other`` does nothing. The turn order is fixed, so the order in
which the collectives go out is the same in every process that runs the same two functions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_current: threading.local = threading.local()  # .baton, .index: the thread's turn holder


class _Baton:
    """Whose turn it is: micro-batch 0 or 1 (a finished one never gets the turn back)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.turn = 0
        self.done = [False, False]

    def wait_turn(self, me: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == me)

    def give(self, me: int) -> None:
        """Hand the turn to the other micro-batch (unless it has finished) and wait for it
        to come back."""
        other = 1 - me
        with self.cond:
            if self.done[other]:
                return
            self.turn = other
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.turn == me)

    def finish(self, me: int) -> None:
        with self.cond:
            self.done[me] = True
            self.turn = 1 - me
            self.cond.notify_all()


def yield_to_other() -> None:
    """Called after starting a collective: under dual-batch overlap the other micro-batch
    runs until it starts one (or ends); otherwise nothing."""
    baton = getattr(_current, "baton", None)
    if baton is not None:
        baton.give(_current.index)


def run_overlapped(first: Callable[[], Any], second: Callable[[], Any]) -> tuple[Any, Any]:
    """Run two micro-batches' forward passes, taking turns at their collectives (see the
    module docstring); their results. An exception in either is raised here (the other is
    let run to its end first: the cores' collectives must still match)."""
    baton = _Baton()
    results: list[Any] = [None, None]
    errors: list[BaseException | None] = [None, None]

    def body(index: int, fn: Callable[[], Any]) -> None:
        import torch

        _current.baton, _current.index = baton, index
        try:
            baton.wait_turn(index)
            with torch.inference_mode():  # (thread-local, as the current CUDA stream)
                results[index] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller's thread
            errors[index] = e
        finally:
            _current.baton = None
            baton.finish(index)

    threads = [
        threading.Thread(target=body, args=(i, fn), name=f"pagedllm-ubatch-{i}", daemon=True)
        for i, fn in enumerate((first, second))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results[0], results[1]

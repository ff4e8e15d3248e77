"""Dual-batch overlap's pieces (issue 55): the micro-batch split of a batch and the turns the
two threads take at their collectives (``distributed/turns.py``), whose order every core
must share."""

from __future__ import annotations

import pytest

from pagedllm.distributed.turns import run_overlapped, yield_to_other
from pagedllm.worker.ubatch import ubatch_split


@pytest.mark.parametrize(
    "n_sched,first",
    [([1, 1, 1, 1], 2), ([100, 1, 1], 1), ([1, 1, 100], 2), ([5], 0), ([], 0), ([3, 3], 1),
     ([1, 1, 1], 2)],
)  # fmt: skip
def test_the_split_takes_the_fewest_first_requests_holding_half_the_tokens(n_sched, first):
    assert ubatch_split(n_sched) == first


def test_the_threads_take_turns_at_each_collective_in_a_fixed_order():
    """a runs to its first collective, then b to its first, then a again...; a thread that
    has finished gives no more turns; outside run_overlapped yielding does nothing."""
    events: list[str] = []

    def micro(name: str, collectives: int):  # noqa: ANN202
        def run() -> str:
            for i in range(collectives):
                events.append(f"{name}{i}")
                yield_to_other()
            events.append(f"{name}-end")
            return name

        return run

    assert run_overlapped(micro("a", 3), micro("b", 1)) == ("a", "b")
    assert events == ["a0", "b0", "a1", "b-end", "a2", "a-end"]
    yield_to_other()  # no overlap: returns at once


def test_an_error_in_one_micro_batch_reaches_the_caller():
    def bad() -> None:
        yield_to_other()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        run_overlapped(bad, lambda: yield_to_other())

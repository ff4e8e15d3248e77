"""The proposer interface the engine calls each step, and ``make_proposer``.

A proposer guesses the next few tokens of a request from its tokens so far, without a model:
the engine verifies the guesses in one forward pass and keeps the verified prefix. It runs on
the engine's host loop, once per step for every running decode request, so each call does
small, incremental work (state per request, grown by the tokens that arrived since the last
call).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from pagedllm.spec_decode.config import SpeculativeConfig


@runtime_checkable
class Proposer(Protocol):
    """Draft tokens for running requests, from state kept per request id.

    Contract with the engine:

    - ``propose`` is called at most once per step per running decode request, with the
      request's tokens so far (prompt + output). Between two calls for one ``req_id`` the
      tokens only grow (the first ones are unchanged); the proposer ingests only the new ones.
      If the tokens shrank or the last one it saw changed, it rebuilds that request's state.
    - ``k`` may differ from call to call (``k >= 0``; 0 gives ``[]``); the draft has at most
      ``k`` tokens, and ``[]`` means no guess this step.
    - ``finish`` is called once when the request ends (finished or aborted); the proposer drops
      the request's state. A request that never got a ``propose`` call may still be finished.
    """

    def propose(
        self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int
    ) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token_ids`` (prompt + output so far)."""
        ...

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """The request ended: drop its state (suffix: its output joins the global cache)."""
        ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The host-side proposer for ``config.method``: ``NgramProposer`` for "ngram" (and for
    "ngram_gpu", whose drafts come from the device: the host one serves the pacer's shadow
    drafts),
    ``SuffixProposer`` for "suffix", ``DraftModelProposals`` for "draft_model" (the model
    runner runs the draft model after each step; this keeps its drafts for the next one)."""
    if config.method in ("ngram", "ngram_gpu"):  # ngram_gpu: the pacer's shadow drafts
        from pagedllm.spec_decode.ngram import NgramProposer

        return NgramProposer(config)
    if config.method == "suffix":
        from pagedllm.spec_decode.suffix import SuffixProposer

        return SuffixProposer(config)
    if config.method == "draft_model":
        from pagedllm.spec_decode.draft_model import DraftModelProposals

        return DraftModelProposals()
    raise ValueError(f"speculative_config.method has no proposer, got {config.method!r}.")


def check_k(k: int) -> int:
    """``k`` as an int, or ``ValueError`` naming it if it is not an integer >= 0."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
        raise ValueError(f"k must be an integer >= 0, got {k!r}.")
    return int(k)

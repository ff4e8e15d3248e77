"""The scheduler's side of a draft model: the drafts the model runner proposed, kept until
the request's next step.

A draft model runs in the model runner (``worker/drafter.py``): right after a step's
samples are known, it proposes k tokens after each sampled request's newest token and the
runner returns them (``ModelRunnerOutput.draft_token_ids``). The scheduler stores them here
with the number of known tokens they follow; ``propose`` hands them out at the request's next
step if the request still has exactly that many tokens (a stop string, an abort or a
preemption in between makes them stale: no drafts then, never wrong ones).
"""

from __future__ import annotations

from collections.abc import Sequence


class DraftModelProposals:
    """The ``Proposer`` of the "draft_model" method: drafts the runner computed, by request.

    Example: the runner proposes [7, 3, 9] after a request's 12 known tokens -> ``store(r,
    12, [7, 3, 9])``; the next step asks ``propose(r, tokens, ..., k=2)`` with 12 tokens ->
    [7, 3]; with 13 tokens (something else was appended) -> [].
    """

    def __init__(self) -> None:
        self._drafts: dict[str, tuple[int, list[int]]] = {}

    def store(self, req_id: str, num_tokens: int, drafts: list[int]) -> None:
        """The runner's drafts for the tokens after the request's first ``num_tokens``."""
        self._drafts[req_id] = (num_tokens, drafts)

    def propose(
        self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int
    ) -> list[int]:
        """Up to ``k`` stored drafts if they follow exactly ``token_ids``; [] otherwise."""
        stored = self._drafts.pop(req_id, None)
        if stored is None or stored[0] != len(token_ids) or k <= 0:
            return []
        return stored[1][:k]

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Drop what is stored for an ended request."""
        self._drafts.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._drafts)

"""Speculative decoding: its config and the proposers (n-gram, suffix, a draft model's store).

The engine asks a ``Proposer`` for up to k draft tokens per running request each step and
verifies them in one forward pass; ``make_proposer`` builds the one a ``SpeculativeConfig``
names (for a draft model: the store of the drafts the model runner computed).
"""

from pagedllm.spec_decode.config import MAX_NUM_SPECULATIVE_TOKENS, METHODS, SpeculativeConfig
from pagedllm.spec_decode.proposer import Proposer, make_proposer

__all__ = [
    "MAX_NUM_SPECULATIVE_TOKENS",
    "METHODS",
    "Proposer",
    "SpeculativeConfig",
    "make_proposer",
]

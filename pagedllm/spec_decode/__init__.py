"""Speculative decoding: its config and the host-side proposers (n-gram, suffix).

The engine asks a ``Proposer`` for up to k draft tokens per running request each step and
verifies them in one forward pass; ``make_proposer`` builds the one a ``SpeculativeConfig``
names (``None`` for a draft model, which the engine runs itself).
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

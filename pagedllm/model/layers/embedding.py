"""Token embeddings and the LM head."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class VocabEmbedding(nn.Module):
    """Embedding table [vocab_size, hidden_size] with a weight loader."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states of the tokens that need logits onto the vocabulary, in float32
    (or in the weights' dtype with ``float32=False``).
    ``tie_to`` shares the embedding's weight (Gemma, SmolLM2)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        tie_to: VocabEmbedding | None = None,
    ) -> None:
        super().__init__()
        if tie_to is not None:
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(
                torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False
            )

    def forward(self, hidden_states: torch.Tensor, float32: bool = True) -> torch.Tensor:
        # [num_selected, hidden] -> [num_selected, vocab]
        logits = F.linear(hidden_states, self.weight)
        return logits.float() if float32 else logits

"""Token embeddings and the LM head, split over the vocabulary under tensor parallelism.

With tp ranks the vocabulary is padded to a multiple of tp and rank r holds rows
[r * V/tp, (r + 1) * V/tp) of the table (``vocab_shard``). The embedding looks up the ids
that fall in its rows, zeros the others and sums over the ranks (all-reduce); the LM head
computes the logits of its rows and gathers every rank's side by side (all-gather), so each
rank holds the whole [n, vocab] logits and samples the same tokens from the same seeds.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pagedllm.distributed.parallel_state import all_gather_last, all_reduce, tp_info
from pagedllm.ops.cpu import pack_linear, packed_linear


def vocab_shard(vocab_size: int) -> tuple[int, int]:
    """(first row, rows) of this rank's part of the table.

    Example: vocab 10, 4 ranks -> padded to 12, 3 rows each; rank 3 holds rows 9..11 (9 real
    tokens' rows plus 2 padding rows that no id reaches and whose logits are cut off)."""
    rank, tp = tp_info()
    per_rank = -(-vocab_size // tp)
    return rank * per_rank, per_rank


def _load_rows(param: nn.Parameter, loaded: torch.Tensor, vocab_size: int) -> None:
    """This rank's rows of a whole [vocab, hidden] checkpoint tensor (padding rows zero)."""
    start, rows = vocab_shard(vocab_size)
    if loaded.shape[0] != vocab_size or loaded.shape[1:] != param.shape[1:]:
        raise ValueError(
            f"weight shape mismatch: expected ({vocab_size}, {param.shape[1]}), "
            f"got {tuple(loaded.shape)}"
        )
    part = loaded[start : start + rows]
    param.data.zero_()
    param.data[: part.shape[0]].copy_(part)


class VocabEmbedding(nn.Module):
    """Embedding table [vocab_size, hidden_size] (this rank's rows under TP) with a weight
    loader."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.start, rows = vocab_shard(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _load_rows(param, loaded, self.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_info()[1] == 1:
            return F.embedding(input_ids, self.weight)
        # ids outside this rank's rows look up row 0 and are zeroed; the sum over the ranks
        # leaves each id's own row
        local = input_ids.long() - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class LMHead(nn.Module):
    """Projects hidden states of the tokens that need logits onto the vocabulary, in float32
    (or in the weights' dtype with ``float32=False``); under TP each rank computes its rows'
    logits and they are gathered (see the module docstring).
    ``tie_to`` shares the embedding's weight (Gemma, SmolLM2)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        tie_to: VocabEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        if tie_to is not None:
            self.weight = tie_to.weight
        else:
            _, rows = vocab_shard(vocab_size)
            self.weight = nn.Parameter(
                torch.empty(rows, hidden_size, dtype=dtype), requires_grad=False
            )
            self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _load_rows(param, loaded, self.vocab_size)

    _packed: torch.Tensor | None = None  # pack_for_cpu

    def pack_for_cpu(self) -> bool:
        """On a CPU in bfloat16, a oneDNN copy of the weight for the logits' matmul
        (``pagedllm.ops.cpu.pack_linear``: the same logits, faster than ``F.linear``'s path on
        a large vocabulary). The plain weight stays (a tied one is the embedding's
        table), so this costs the head's size once more in memory."""
        if tp_info()[1] > 1:
            return False
        self._packed = pack_linear(self.weight.data)
        return self._packed is not None

    def _logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return packed_linear(hidden_states, self._packed, None)
        return F.linear(hidden_states, self.weight)

    def forward(self, hidden_states: torch.Tensor, float32: bool = True) -> torch.Tensor:
        # [num_selected, hidden] -> [num_selected, vocab]
        logits = self._logits(hidden_states)
        if tp_info()[1] > 1:
            logits = all_gather_last(logits)[:, : self.vocab_size]
        return logits.float() if float32 else logits

    def argmax(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n] int64: the argmax of the logits (the first of equal maxima, as
        ``torch.argmax``). Under TP each rank takes its rows' maximum and only (value, id)
        pairs are gathered, not [n, vocab] logits.

        Example: 2 ranks, vocab 6 (rows 0-2 and 3-5), a row's logits [1, 4, 4 | 4, 0, 2]:
        rank 0 holds (4, 1), rank 1 (4, 3); the largest value's first rank wins: id 1."""
        logits = self._logits(hidden_states)  # [n, rows]
        rank, tp = tp_info()
        if tp == 1:
            return logits[:, : self.vocab_size].argmax(-1)
        first, rows = vocab_shard(self.vocab_size)
        real = min(rows, self.vocab_size - first)  # the last rank's padding rows excluded
        n = logits.shape[0]
        if real > 0:
            ids = logits[:, :real].argmax(-1, keepdim=True)  # [n, 1]
            vals = logits.gather(1, ids).float()
        else:  # a rank with only padding rows (tiny vocabularies)
            ids = torch.zeros(n, 1, dtype=torch.long, device=logits.device)
            vals = torch.full((n, 1), float("-inf"), device=logits.device)
        # ids < 2^24 are exact in float32
        pairs = all_gather_last(torch.cat([vals, (ids + first).float()], 1)).view(n, tp, 2)
        best = pairs[:, :, 0].argmax(-1, keepdim=True)  # [n, 1]: the first rank on ties
        return pairs[:, :, 1].gather(1, best).squeeze(1).long()

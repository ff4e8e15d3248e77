"""A draft model in the model runner: its KVs, and its k greedy drafts after each step.

The draft model (speculative_config method "draft_model": a smaller model with the target's
tokenizer) lives on the target's device, in the same process. Its attention layers join the
target's in the KV cache (``ModelRunner._attention_layers``: their specs follow the target's,
so a block id holds a block of both models' KVs and the KV manager counts both); it reads and
writes the same block tables, so prefix caching, copy-on-write, swap and preemption treat both
models' KVs alike.

Each step, two things:

1. ``mirror`` (queued behind the target's forward pass): the draft model runs over the
   step's prompt chunks, writing its KVs at the same slots as the target. Decode and
   verification rows that draft after the step are left out (their KVs come with the first
   draft pass, below); rows whose draft KVs lag - steps skipped while speculation was paused
   under load (``disable_by_batch_size``), or a row that did not draft - start at their first
   missing position (``InputBatch.draft_computed``), within the step's token budget
   (``ModelRunner._mirror``).
2. ``propose`` (after the step's samples are known, on the host): for each request that got
   lookahead slots (``SchedulerOutput.draft_requests``), the first pass computes the draft
   KVs from the first missing position up to the newest token q (the verified token and
   accepted drafts, then the new token), then each argmax is fed back in, one token per
   request and pass: drafts d_1..d_k, whose KVs land at positions q..q+k-1 (the lookahead
   slots; the target overwrites them when it verifies). Passes shrink as requests reach
   their own k. Only the new token's KV counts as written afterwards (the drafts' are
   unverified): a verification step needs one draft pass fewer than with a mirror of it.

Why greedy drafts keep sampling exact: a draft chosen by argmax is a draft distribution q
with all its mass on it, the case ``core/sched/spec.py`` verifies (accept d with probability
p(d), else sample p without d): every emitted token has the target's distribution.

Example (k 3): a request with known tokens t0..t9 and draft KVs up to position 9 verifies
drafts [a, b, c] at positions 10..12 (scheduled tokens t9, a, b, c at 9..12, samples
s0..s3; left out of the mirror). Samples [a, b, x, .] -> 2 accepted, new token x at q = 12.
Propose: pass 1 feeds t9, a, b, x at 9..12 -> d1 (from x's logits), pass 2 feeds d1 at 13 ->
d2, pass 3 feeds d2 at 14 -> d3; the drafts [d1, d2, d3] follow the 13 known tokens t0..t9,
a, b, x; draft KVs now count up to position 12.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedllm.model.loader import build_model
from pagedllm.worker.cuda_graph import CUDAGraphRunner
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.inputs import InputPreparer, StepInputs


class Drafter:
    """The draft model of speculative decoding, run by the model runner (see the module
    docstring)."""

    def __init__(self, model_config: Any, device: torch.device, backend: Any) -> None:
        self.model = build_model(model_config, str(device))
        self.device = device
        for layer in self.model.attention_layers():
            layer.backend = backend
        # on a GPU: the draft model's own graphs (its one-token passes, its first pass of up
        # to k + 2 tokens per request, and a mirror whose rows fit those)
        self.graph_runner: CUDAGraphRunner | None = None

    def capture_cuda_graphs(self, **kw: Any) -> None:
        """Capture the draft model's decode graphs (``CUDAGraphRunner``'s arguments but the
        model); after the KV cache is bound."""
        self.graph_runner = CUDAGraphRunner(self.model, **kw)
        self.graph_runner.capture()

    def _run(self, inputs: StepInputs) -> torch.Tensor:
        md = inputs.metadata
        gr = self.graph_runner
        if gr is not None and gr.can_run(md.num_reqs, md.max_query_len):
            return gr.run(inputs.input_ids, inputs.positions, md)
        return self.model(inputs.input_ids, inputs.positions, md)

    def attention_layers(self) -> list[torch.nn.Module]:
        """The draft model's attention layers (they follow the target's in the KV cache)."""
        return self.model.attention_layers()

    @torch.inference_mode()
    def mirror(self, inputs: StepInputs) -> None:
        """The draft model's KVs for the step's input tokens, at the target's slots."""
        self._run(inputs)

    @torch.inference_mode()
    def propose(
        self,
        batch: InputBatch,
        preparer: InputPreparer,
        rows: np.ndarray,
        positions: np.ndarray,
        tokens: np.ndarray,
        num_drafts: np.ndarray,
        starts: np.ndarray,
    ) -> list[list[int]]:
        """Greedy drafts after each request's newest token.

        ``rows`` [R]: the requests' InputBatch rows; ``positions`` [R]: the newest token's
        position q; ``tokens`` [R]: that token; ``num_drafts`` [R] (>= 1): the drafts wanted,
        whose KVs go to positions q .. q + n - 1 (slots the scheduler allocated); ``starts``
        [R] (<= q): the first position whose draft KV is missing - the first pass computes
        starts .. q (known tokens from the batch, then the new one). Returns the drafts of
        each request, in ``rows``' order.
        """
        # longest first: pass j runs the first m_j requests (those wanting >= j drafts)
        # Example: num_drafts [2, 4, 1] -> order [1, 0, 2], passes of 3, 2, 1, 1 requests
        order = np.argsort(-num_drafts, kind="stable")
        rows, positions, want = rows[order], positions[order], num_drafts[order]
        first_n = positions - starts[order] + 1  # [R] tokens of the first pass
        current = torch.from_numpy(tokens[order].astype(np.int64)).to(self.device)
        outs: list[torch.Tensor] = []
        saved = batch.num_computed_tokens[rows].copy()
        try:
            for j in range(int(want[0])):
                m = int(np.count_nonzero(want > j))
                active = rows[:m]
                if j == 0 and (first_n > 1).any():
                    # starts .. q per request; the new token is each request's last input
                    # Example: first_n [3, 1] -> last token indices [2, 3]
                    batch.num_computed_tokens[active] = positions - first_n + 1
                    last = np.cumsum(first_n) - 1
                    inputs = preparer.prepare(active, first_n, (last,))
                    last_t = inputs.extra[0].long()
                    inputs.input_ids[last_t] = current.to(inputs.input_ids.dtype)
                    hidden = self._run(inputs).index_select(0, last_t)
                else:
                    # one token per request at q + j: inputs as for a decode step there
                    batch.num_computed_tokens[active] = positions[:m] + j
                    inputs = preparer.prepare(active, np.ones(m, dtype=np.int64))
                    inputs.input_ids.copy_(current[:m])
                    hidden = self._run(inputs)
                current = self.model.compute_logits(hidden, float32=False).argmax(-1)  # [m]
                outs.append(current)
        finally:
            batch.num_computed_tokens[rows] = saved
        # [R, k] on the host in one copy; pass j's m_j requests fill column j
        k = len(outs)
        flat = torch.full((len(rows), k), -1, dtype=torch.int64, device=self.device)
        for j, out in enumerate(outs):
            flat[: out.shape[0], j] = out
        host = flat.cpu().numpy()
        drafts: list[list[int]] = [[] for _ in range(len(rows))]
        for i, src in enumerate(order.tolist()):
            drafts[src] = host[i, : int(want[i])].tolist()
        return drafts

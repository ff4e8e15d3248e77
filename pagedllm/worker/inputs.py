"""Building one step's model inputs with numpy, moved to the device in one copy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kv_layout import dcp_slot_mapping, slot_mapping
from pagedllm.worker.input_batch import InputBatch


@dataclass
class StepInputs:
    """Flattened token inputs of one step and the attention metadata describing them."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    n_sched: np.ndarray  # [num_reqs] tokens per request
    extra: list[torch.Tensor]  # the caller's extra int arrays, on the device


class InputPreparer:
    """Prepares inputs for the rows of an InputBatch.

    On a GPU every per-step integer array is packed into one pinned int32 host buffer and sent
    with a single non-blocking host-to-device copy; the tensors are views of the device copy.
    On the CPU the numpy arrays are used in place. The pinned buffer is double-buffered: under
    async scheduling step N+1 is prepared while step N's copy may still be queued.
    """

    def __init__(
        self,
        batch: InputBatch,
        max_num_tokens: int,
        device: torch.device,
        dcp: tuple[int, int] = (0, 1),
    ) -> None:
        self.batch = batch
        self.device = device
        # LoRA (``pagedllm/lora/worker.py``): told each step's rows, to set adapter slots
        self.lora: Any = None
        # decode context parallelism: (this rank, ranks); the batch's tables are the
        # scheduler's, this rank stores every ranks-th position (kv_layout.dcp_slot_mapping)
        self.dcp = dcp
        r = batch.max_num_reqs
        # ids, positions, slots per token; qsl, seq_lens, block table per request
        # (+ the caller's extras: up to 3 arrays, the first of up to one entry per token - the
        # logits' token indices, several per request with draft tokens - the others of up to
        # one entry per request)
        g = batch.num_kv_groups  # slots and block tables come once per KV-cache group
        cap = (3 + g) * max_num_tokens + 4 * r + 1 + g * r * batch.max_blocks_per_req
        self.use_staging = device.type == "cuda"
        if self.use_staging:
            self.hosts = [torch.zeros(cap, dtype=torch.int32, pin_memory=True) for _ in "ab"]
            # the end of the last copy out of each host buffer: a buffer is rewritten only
            # after it (a draft model prepares several passes per step without a sync)
            self._copied: list[torch.cuda.Event | None] = [None, None]
            self._turn = 0
            self.dev = torch.zeros(cap, dtype=torch.int32, device=device)

    def prepare(
        self, rows: np.ndarray, n_sched: np.ndarray, extra: tuple[np.ndarray, ...] = ()
    ) -> StepInputs:
        """Inputs for requests at ``rows`` computing ``n_sched`` tokens each, from their
        ``num_computed_tokens`` on; ``extra`` int arrays (at most 3: the first no longer than
        the step's tokens, the others than ``rows``) travel in the same host-to-device copy."""
        ib = self.batch
        if self.lora is not None:
            self.lora.prepare(ib.lora_ids[rows], n_sched)
        bs = ib.block_size
        cu = np.cumsum(n_sched)
        total = int(cu[-1])
        # Example: n_sched [2, 5, 3] -> req_idx [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
        #                               offsets [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]
        req_idx = np.repeat(np.arange(len(rows)), n_sched)
        offsets = np.arange(total) - np.repeat(cu - n_sched, n_sched)
        token_rows = rows[req_idx]
        positions = ib.num_computed_tokens[token_rows] + offsets
        input_ids = ib.token_ids[token_rows, positions]
        dcp_size = self.dcp[1]
        if dcp_size == 1:
            slots = slot_mapping(ib.block_table, token_rows, positions, bs)  # [G, num_tokens]
        else:
            slots = dcp_slot_mapping(ib.block_table, token_rows, positions, bs, *self.dcp)
        seq_lens = ib.num_computed_tokens[rows] + n_sched
        qsl = np.zeros(len(rows) + 1, dtype=np.int64)
        qsl[1:] = cu
        max_blocks = int(-(-int(seq_lens.max()) // bs))
        block_tables = ib.block_table[:, rows, :max_blocks]  # [G, num_reqs, max_blocks]
        num_groups = ib.num_kv_groups
        if self.use_staging:
            parts = [input_ids, positions, qsl, seq_lens, slots.reshape(-1)]
            views = self._ship(parts + [block_tables.reshape(-1)] + list(extra))
            ids_t, pos_t, qsl_t, sl_t, slot_t, bt_t = views[:6]
            extra_t = views[6:]
            slot_t = slot_t.long().view(num_groups, total)
            bt_t = bt_t.view(num_groups, len(rows), max_blocks)
        else:
            ids_t, pos_t = torch.from_numpy(input_ids), torch.from_numpy(positions)
            slot_t = torch.from_numpy(slots)
            qsl_t = torch.from_numpy(qsl.astype(np.int32))
            sl_t = torch.from_numpy(seq_lens.astype(np.int32))
            bt_t = torch.from_numpy(np.ascontiguousarray(block_tables))
            extra_t = [torch.from_numpy(np.asarray(e, dtype=np.int64)) for e in extra]
        md = AttentionMetadata(
            num_reqs=len(rows),
            num_actual_tokens=total,
            query_start_loc=qsl_t,
            seq_lens=sl_t,
            slot_mapping=slot_t[0],
            block_tables=bt_t[0],
            max_query_len=int(n_sched.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=bs // dcp_size,
            query_start_loc_np=qsl,
            seq_lens_np=seq_lens,
            dcp=self.dcp if dcp_size > 1 else None,
        )
        md.plan["block_tables_np"] = block_tables[0]
        if num_groups > 1:
            md.set_groups(slot_t, bt_t)
            for g in range(1, num_groups):
                md.groups[g].plan["block_tables_np"] = block_tables[g]
        return StepInputs(ids_t, pos_t, md, n_sched, extra_t)

    def _ship(self, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """Pack int arrays into the pinned buffer, copy once, return device views."""
        offs = [0]
        for p in parts:
            offs.append(offs[-1] + p.size)
        turn = self._turn
        host = self.hosts[turn]
        self._turn ^= 1
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # done long ago, but for back-to-back passes
        host_np = host.numpy()
        for p, a in zip(parts, offs):
            host_np[a : a + p.size] = p
        n = offs[-1]
        self.dev[:n].copy_(host[:n], non_blocking=True)
        event = self._copied[turn] = torch.cuda.Event()
        event.record()
        return [self.dev[a:b] for a, b in zip(offs[:-1], offs[1:])]

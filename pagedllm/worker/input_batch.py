"""The model runner's persistent per-request state, kept in preallocated numpy arrays.

Each live request owns a row. Token ids, progress and block tables are written into the rows
once and updated in place, so preparing a step's inputs is a few vectorized numpy gathers, with
no per-request Python loop over tokens.
"""

from __future__ import annotations

import numpy as np

from pagedllm.core.sched.output import NewRequestData
from pagedllm.sample.constraints import RowConstraints
from pagedllm.sampling_params import SamplingParams, SamplingType


class SamplingColumns:
    """Each row's sampling parameters as numpy columns, so a step's metadata is a few
    vectorized gathers instead of Python over every row's SamplingParams (at hundreds of rows
    that loop is a visible share of a step's host time). The InputBatch keeps one row per
    request slot, written once when the request gets its row."""

    def __init__(self, num_rows: int) -> None:
        self.values = np.zeros((num_rows, 4), dtype=np.float32)  # temperature, top_p, top_k, min_p
        self.greedy = np.ones(num_rows, dtype=bool)
        self.seeded = np.zeros(num_rows, dtype=bool)  # SamplingType.RANDOM_SEED
        self.penalized = np.zeros(num_rows, dtype=bool)
        self.min_tokens = np.zeros(num_rows, dtype=np.int64)
        self.logprobs = np.full(num_rows, -1, dtype=np.int64)  # -1: none
        self.forks = np.zeros(num_rows, dtype=np.int64)  # sequences to fork at output 0
        # logit_bias / allowed_token_ids / bad_words as arrays (sample/constraints.py)
        self.constrained = np.zeros(num_rows, dtype=bool)
        self.constraints: list[RowConstraints | None] = [None] * num_rows

    def write(self, row: int, p: SamplingParams) -> None:
        self.values[row] = (p.temperature, p.top_p, float(p.top_k), p.min_p)
        kind = p.sampling_type
        self.greedy[row] = kind == SamplingType.GREEDY
        self.seeded[row] = kind == SamplingType.RANDOM_SEED
        self.penalized[row] = p.uses_penalties
        self.min_tokens[row] = p.min_tokens
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.forks[row] = p.num_sequences - 1
        self.constraints[row] = RowConstraints.of(p)
        self.constrained[row] = self.constraints[row] is not None


class InputBatch:
    """Rows of request state: token ids, counts, block table and sampling parameters."""

    def __init__(
        self, max_num_reqs: int, max_model_len: int, block_size: int, num_kv_groups: int = 1
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks_per_req = -(-max_model_len // block_size) + 1
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # speculative decoding with a draft model: positions whose draft-model KVs are written
        # (behind num_computed_tokens after steps that skipped the draft model under load;
        # worker/drafter.py); a request's prefix-cache hit counts as written
        self.draft_computed = np.zeros(max_num_reqs, dtype=np.int64)
        # one table per KV-cache group, addressed by token position (entries of a sliding-window
        # group that fell out of the window are stale or 0 and never read)
        self.num_kv_groups = num_kv_groups
        shape = (num_kv_groups, max_num_reqs, self.max_blocks_per_req)
        self.block_table = np.zeros(shape, dtype=np.int32)  # [groups, rows, max_blocks]
        self.num_blocks = np.zeros((num_kv_groups, max_num_reqs), dtype=np.int64)
        # bumped whenever a row gets a new request: results of a step launched before that
        # (async scheduling) must not be written into the new owner's row
        self.epoch = np.zeros(max_num_reqs, dtype=np.int64)
        # beam search: the scheduler, not the sampler, chooses the row's next token
        self.external = np.zeros(max_num_reqs, dtype=bool)
        self.lora_ids = np.zeros(max_num_reqs, dtype=np.int64)  # LoRA adapter (0: none)
        self.sampling_params: list[SamplingParams | None] = [None] * max_num_reqs
        #: rows whose request asked for prompt logprobs (none: a step skips looking for them)
        self.num_prompt_logprobs = 0
        self.columns = SamplingColumns(max_num_reqs)  # the same parameters, as columns
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_row: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.req_id_to_row)

    def add_request(self, new: NewRequestData) -> int:
        """Give a new (or resumed) request a row and copy its tokens and blocks in."""
        if not self._free_rows:
            raise RuntimeError("input batch full: more requests than max_num_seqs")
        row = self._free_rows.pop()
        tokens = new.prompt_token_ids + new.output_token_ids
        n = len(tokens)
        self.token_ids[row, :n] = tokens
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.draft_computed[row] = new.num_computed_tokens
        self.num_blocks[:, row] = 0
        self.append_blocks(row, new.block_ids)
        self.sampling_params[row] = new.sampling_params
        self.num_prompt_logprobs += new.sampling_params.prompt_logprobs is not None
        self.columns.write(row, new.sampling_params)
        self.external[row] = new.sampling_params.external_tokens
        self.lora_ids[row] = new.lora_int_id
        self.epoch[row] += 1
        self.req_ids[row] = new.req_id
        self.req_id_to_row[new.req_id] = row
        return row

    def remove_request(self, req_id: str) -> None:
        """Free a request's row (unknown ids are ignored)."""
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return
        params = self.sampling_params[row]
        self.num_prompt_logprobs -= params is not None and params.prompt_logprobs is not None
        self.sampling_params[row] = None
        self.req_ids[row] = None
        self._free_rows.append(row)

    def append_blocks(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        """Extend a row's block table of each group by that group's new block ids."""
        for g, ids in enumerate(block_ids):
            if ids:
                start = int(self.num_blocks[g, row])
                self.block_table[g, row, start : start + len(ids)] = ids
                self.num_blocks[g, row] = start + len(ids)

    def append_token(self, row: int, token_id: int) -> None:
        """Append one token to a row's token ids."""
        n = int(self.num_tokens[row])
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1

    def prompt_ids(self, row: int) -> list[int]:
        """The prompt tokens of a row."""
        return self.token_ids[row, : self.num_prompt_tokens[row]].tolist()

    def output_ids(self, row: int) -> list[int]:
        """The generated tokens of a row."""
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]].tolist()

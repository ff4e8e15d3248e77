"""ngram_gpu's pieces against their host references (CPU tensors here, CUDA where there is a
GPU): the batched lookup against ``ngram_propose``, the position / slot / length correction
of an async step against the host's arrays for the true positions, and one verification
(acceptance, bonus token, history, next drafts) against a hand-computed case."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kv_layout import slot_mapping
from pagedllm.spec_decode.ngram import ngram_propose
from pagedllm.spec_decode.ngram_gpu import ngram_propose_rows
from pagedllm.worker.device_drafts import DeviceDrafts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("seed", range(4))
def test_lookup_matches_the_host_proposer(seed: int) -> None:
    """Random rows over small vocabularies (many repeats), every n range and k, rows of
    length 1 to the width: the same drafts as the host proposer, row by row."""
    rng = np.random.default_rng(seed)
    checked = 0
    for _ in range(60):
        rows, width = int(rng.integers(1, 9)), int(rng.integers(2, 70))
        vocab = int(rng.integers(2, 7))
        lens = rng.integers(1, width + 1, size=rows)
        hist = rng.integers(0, vocab, size=(rows, width))
        min_n = int(rng.integers(1, 4))
        max_n, k = int(rng.integers(min_n, 6)), int(rng.integers(1, 6))
        drafts, num_valid = ngram_propose_rows(
            torch.from_numpy(hist).to(DEVICE, torch.int32),
            torch.from_numpy(lens).to(DEVICE),
            min_n,
            max_n,
            k,
        )
        drafts, num_valid = drafts.cpu(), num_valid.cpu()
        for r in range(rows):
            want = ngram_propose(hist[r, : lens[r]].astype(np.int64), min_n, max_n, k)
            assert drafts[r, : num_valid[r]].tolist() == want, (hist[r, : lens[r]], min_n, max_n)
            assert not drafts[r, num_valid[r] :].any()  # zeros past the valid drafts
            checked += bool(want)
    assert checked > 20  # many rows found a draft


def test_lookup_docstring_example() -> None:
    row = torch.tensor([[1, 2, 3, 4, 9, 2, 3, 8, 1, 2, 3, 0, 0]], dtype=torch.int32)
    drafts, num_valid = ngram_propose_rows(row, torch.tensor([11]), 2, 3, 2)
    assert drafts.tolist() == [[4, 9]] and num_valid.tolist() == [2]


@pytest.mark.parametrize("groups", [1, 2])
def test_correction_gives_the_true_positions_slots_and_lengths(groups: int) -> None:
    """Three requests of an async step planned as if their last drafts were all accepted: a
    decode row that verified 4 drafts and kept 1 (3 over-counted), one whose last step is
    resolved (0), a verify row that kept 0 of 2 (2). After ``correct``: positions, lengths
    and slots (each group's table) equal the host's arrays built from the true positions."""
    bs, max_blocks = 4, 6
    rng = np.random.default_rng(0)
    tables = rng.permutation(200)[: groups * 3 * max_blocks].reshape(groups, 3, max_blocks)
    tables = tables.astype(np.int32)
    n_sched = np.array([5, 1, 3])  # 1 + 4 drafts, a plain decode, 1 + 2 drafts
    true_start = np.array([9, 13, 6])  # positions of each row's first token
    delta = np.array([3, 0, 2])
    host_start = true_start + delta

    def arrays(start: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        req = np.repeat(np.arange(3), n_sched)
        pos = (
            start[req] + np.arange(n_sched.sum()) - np.repeat(np.cumsum(n_sched) - n_sched, n_sched)
        )
        return pos, start + n_sched, slot_mapping(tables, req, pos, bs)  # [T], [R], [G, T]

    pos_h, lens_h, slots_h = arrays(host_start)
    pos_t, lens_t, slots_t = arrays(true_start)
    positions = torch.from_numpy(pos_h.astype(np.int32)).to(DEVICE)
    slots = torch.from_numpy(slots_h).to(DEVICE)
    bt = torch.from_numpy(tables).to(DEVICE)
    md = AttentionMetadata(
        num_reqs=3,
        num_actual_tokens=int(n_sched.sum()),
        query_start_loc=torch.zeros(4, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.from_numpy(lens_h.astype(np.int32)).to(DEVICE),
        slot_mapping=slots[0],
        block_tables=bt[0],
        max_query_len=5,
        max_seq_len=int(lens_h.max()),
        block_size=bs,
    )
    if groups > 1:
        md.set_groups(slots, bt)
    dd = DeviceDrafts(4, 64, 4, 1, 3, DEVICE)
    dd.correct(positions, md, n_sched, torch.from_numpy(delta).to(DEVICE))
    assert positions.cpu().tolist() == pos_t.tolist()
    assert md.seq_lens.cpu().tolist() == lens_t.tolist()
    assert slots.cpu().tolist() == slots_t.tolist()
    if groups > 1:
        assert md.groups[1].slot_mapping.cpu().tolist() == slots_t[1].tolist()


def test_delta_is_the_rejected_drafts_of_unresolved_steps() -> None:
    dd = DeviceDrafts(4, 64, 4, 1, 3, DEVICE)
    dd.accepted[:] = torch.tensor([1, 4, 0, 2])
    rows = torch.tensor([0, 1, 2, 3], device=DEVICE)
    unverified = torch.tensor([4, 4, 0, 3], device=DEVICE)  # row 2: its last step is resolved
    assert dd.delta(rows, unverified).cpu().tolist() == [3, 0, 0, 1]


def test_one_verification_step() -> None:
    """Row 2 verifies drafts [5, 8] made by the lookup; its samples [5, 6, 3] accept 1 draft:
    the bonus is 6, the history gains 5 and 6 (not 3), its length is 12, and its next drafts
    are the lookup over the new history. Row 0 ends a prompt (no drafts): its sample joins
    its history. Both rows' drafts are written into the next inputs where they belong."""
    k = 2
    dd = DeviceDrafts(4, 64, k, 1, 2, DEVICE)
    row2 = np.array([7, 5, 8, 1, 7, 5, 6, 2, 7, 9], dtype=np.int64)  # 10 known, last 9
    dd.add_rows([2, 0], [row2, np.array([4, 4, 4], dtype=np.int64)])
    dd.drafts[2] = torch.tensor([5, 8], dtype=torch.int32)
    dd.num_valid[2] = 2
    # the step: row 0 (prompt's last chunk, 1 sample), row 2 (9 at position 9, drafts at 10, 11)
    input_ids = torch.tensor([4, 9, 0, 0], dtype=torch.int32, device=DEVICE)
    drafts, valid = dd.draft_inputs(input_ids, np.array([2]), np.array([1]), np.array([2]))
    assert input_ids.cpu().tolist() == [4, 9, 5, 8]
    assert valid.cpu().tolist() == [[True, True]]
    samples = torch.tensor([4, 5, 6, 3], device=DEVICE)  # row 0: [4]; row 2: [5, 6, 3]
    bonus = dd.verify(
        samples,
        rows=torch.tensor([0, 2], device=DEVICE),
        first=torch.tensor([0, 1], device=DEVICE),
        ks=torch.tensor([0, 2], device=DEVICE),
        seq_lens=torch.tensor([3, 12], device=DEVICE),
        drafts=drafts,
        valid=valid,
        draft_idx=torch.tensor([1], device=DEVICE),
        width=13,
    )
    assert bonus.cpu().tolist() == [4, 6]
    assert dd.accepted[[0, 2]].cpu().tolist() == [0, 1]
    assert dd.lens[[0, 2]].cpu().tolist() == [4, 12]
    new2 = np.concatenate([row2, [5, 6]])
    assert dd.hist[2, :12].cpu().tolist() == new2.tolist()
    assert dd.hist[0, :4].cpu().tolist() == [4, 4, 4, 4]
    want2 = ngram_propose(new2, 1, 2, k)  # [2, 7]: what followed the last "5 6"
    assert dd.drafts[2, : dd.num_valid[2]].cpu().tolist() == want2 == [2, 7]
    assert dd.drafts[0, : dd.num_valid[0]].cpu().tolist() == ngram_propose(
        np.array([4, 4, 4, 4]), 1, 2, k
    )

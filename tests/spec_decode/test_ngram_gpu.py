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


def step_metadata(
    slots: torch.Tensor,
    tables: np.ndarray,
    n_sched: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """A step's attention metadata from its slots [G, T], tables [G, R, blocks], tokens per
    row and lengths (every KV group's, as the runner's InputPreparer gives them)."""
    bt = torch.from_numpy(tables.astype(np.int32)).to(device)
    qsl = np.concatenate([[0], np.cumsum(n_sched)]).astype(np.int32)
    md = AttentionMetadata(
        num_reqs=len(n_sched),
        num_actual_tokens=int(n_sched.sum()),
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        slot_mapping=slots[0],
        block_tables=bt[0],
        max_query_len=int(n_sched.max()),
        max_seq_len=int(seq_lens.max()),
        block_size=block_size,
    )
    if slots.shape[0] > 1:
        md.set_groups(slots, bt)
    return md


def _correction_case(groups: int, device: torch.device) -> dict:
    """Three requests of an async step planned as if their last drafts were all accepted: a
    decode row that verified 4 drafts and kept 1 (3 over-counted), one whose last step is
    resolved (0), a verify row that kept 0 of 2 (2); the host's arrays for the planned and
    for the true positions."""
    bs, max_blocks = 4, 6
    rng = np.random.default_rng(0)
    tables = rng.permutation(200)[: groups * 3 * max_blocks].reshape(groups, 3, max_blocks)
    tables = tables.astype(np.int32)
    n_sched = np.array([5, 1, 3])  # 1 + 4 drafts, a plain decode, 1 + 2 drafts
    true_start = np.array([9, 13, 6])  # positions of each row's first token
    unverified = np.array([4, 0, 2])
    accepted = np.array([1, 3, 0])  # (row 1's last verification is resolved: not read)
    delta = np.array([3, 0, 2])

    def arrays(start: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        req = np.repeat(np.arange(3), n_sched)
        cu = np.cumsum(n_sched) - n_sched
        pos = start[req] + np.arange(n_sched.sum()) - np.repeat(cu, n_sched)
        return pos, start + n_sched, slot_mapping(tables, req, pos, bs)  # [T], [R], [G, T]

    pos_h, lens_h, slots_h = arrays(true_start + delta)
    slots = torch.from_numpy(slots_h).to(device)
    md = step_metadata(slots, tables, n_sched, lens_h, bs, device)
    return {
        "md": md,
        "slots": slots,
        "positions": torch.from_numpy(pos_h.astype(np.int32)).to(device),
        "n_sched": n_sched,
        "unverified": unverified,
        "accepted": accepted,
        "want": arrays(true_start),
    }


@pytest.mark.parametrize("groups", [1, 2])
def test_correction_gives_the_true_positions_slots_and_lengths(groups: int) -> None:
    """After ``prepare``: positions, lengths and slots (each group's table) equal the host's
    arrays built from the true positions; the drafts of the rows that verify them are in the
    input ids after their first token, and returned with their valid mask."""
    c = _correction_case(groups, DEVICE)
    dd = DeviceDrafts(4, 64, 4, 1, 3, DEVICE)
    rows = np.array([2, 0, 3])
    dd.accepted[torch.from_numpy(rows).to(DEVICE)] = torch.from_numpy(c["accepted"]).to(DEVICE)
    dd.drafts[2] = torch.tensor([11, 12, 13, 14], dtype=torch.int32)
    dd.num_valid[2] = 3  # the lookup found 3
    dd.drafts[3] = torch.tensor([21, 22, 23, 24], dtype=torch.int32)
    dd.num_valid[3] = 4
    input_ids = torch.arange(100, 109, dtype=torch.int32, device=DEVICE)
    ks = np.array([4, 0, 2])
    used, valid = dd.prepare(
        input_ids, c["positions"], c["md"], c["n_sched"], rows, c["unverified"], ks
    )
    pos_t, lens_t, slots_t = c["want"]
    assert c["positions"].cpu().tolist() == pos_t.tolist()
    assert c["md"].seq_lens.cpu().tolist() == lens_t.tolist()
    assert c["slots"].cpu().tolist() == slots_t.tolist()
    if groups > 1:
        assert c["md"].groups[1].slot_mapping.cpu().tolist() == slots_t[1].tolist()
    assert input_ids.cpu().tolist() == [100, 11, 12, 13, 14, 105, 106, 21, 22]
    assert used[0].cpu().tolist() == [11, 12, 13, 14] and used[2, :2].cpu().tolist() == [21, 22]
    assert valid.bool().cpu().tolist() == [
        [True, True, True, False],  # ks 4, the lookup's 3
        [False] * 4,
        [True, True, False, False],  # ks 2
    ]


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
    its history."""
    k = 2
    dd = DeviceDrafts(4, 64, k, 1, 2, DEVICE)
    row2 = np.array([7, 5, 8, 1, 7, 5, 6, 2, 7, 9], dtype=np.int64)  # 10 known, last 9
    dd.add_rows([2, 0], [row2, np.array([4, 4, 4], dtype=np.int64)])
    # the step: row 0 (a prompt's last token, 1 sample), row 2 (9 at 9, drafts at 10, 11)
    used = torch.tensor([[0, 0], [5, 8]], dtype=torch.int32, device=DEVICE)
    valid = torch.tensor([[False, False], [True, True]], device=DEVICE)
    samples = torch.tensor([4, 5, 6, 3], device=DEVICE)  # row 0: [4]; row 2: [5, 6, 3]
    seq_lens = torch.tensor([3, 12], dtype=torch.int32, device=DEVICE)
    bonus, found = dd.verify(
        samples,
        rows=np.array([0, 2]),
        first=np.array([0, 1]),
        ks=np.array([0, 2]),
        batch_idx=np.array([0, 1]),
        seq_lens=seq_lens,
        used=used,
        valid=valid,
        width=13,
    )
    assert bonus.cpu().tolist() == [4, 6]
    assert found.cpu().tolist() == dd.num_valid[[0, 2]].cpu().tolist()  # the next lookups
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

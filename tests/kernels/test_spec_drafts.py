"""The ngram_gpu kernels (``pagedllm/ops/spec_drafts.py``) against ``DeviceDrafts``' PyTorch
path on random steps: corrected positions, lengths and slots, draft inputs, the drafts kept
for verification; then acceptance, bonus tokens, histories, lengths and the next lookup.

On a machine without CUDA the kernels run through Triton's interpreter.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels.triton_setup import DEVICE

# isort: split

from pagedllm.kv_layout import slot_mapping
from pagedllm.worker.device_drafts import DeviceDrafts
from tests.spec_decode.test_ngram_gpu import step_metadata


def _state(rng: np.random.Generator, k: int, min_n: int, max_n: int) -> DeviceDrafts:
    """8 rows with random histories over a small vocabulary (the lookup finds repeats),
    random last acceptances and random newest drafts."""
    dd = DeviceDrafts(8, 96, k, min_n, max_n, DEVICE)
    lens = rng.integers(8, 60, 8)
    dd.add_rows(list(range(8)), [rng.integers(0, 5, n) for n in lens])
    dd.accepted[:] = torch.from_numpy(rng.integers(0, k + 1, 8))
    dd.drafts[:] = torch.from_numpy(rng.integers(0, 5, (8, k)).astype(np.int32))
    dd.num_valid[:] = torch.from_numpy(rng.integers(0, k + 1, 8))
    return dd


def _step(rng: np.random.Generator, dd: DeviceDrafts, groups: int) -> dict:
    """A step over 5 of the rows: decode rows verifying up to k drafts, some with unverified
    drafts of an unresolved last step, and a prefill chunk."""
    k, bs = dd.k, 4
    rows = rng.permutation(8)[:5]
    unverified = np.where(rng.random(5) < 0.6, rng.integers(1, k + 1, 5), 0)
    ks = rng.integers(0, k + 1, 5)
    n_sched = 1 + ks
    ks[4], unverified[4], n_sched[4] = 0, 0, 7  # a prompt chunk
    # a row's last step accepted at most the drafts it verified
    rows_t = torch.from_numpy(rows).to(DEVICE)
    acc = dd.accepted[rows_t].cpu().numpy()
    dd.accepted[rows_t] = torch.from_numpy(np.minimum(acc, unverified)).to(DEVICE)
    lens = dd.lens[rows_t].cpu().numpy()
    start = lens - 1 + unverified  # as the host plans: unverified drafts counted
    start[4] = lens[4] - 7
    max_blocks = (int((start + n_sched).max()) + bs) // bs
    tables = rng.permutation(400)[: groups * 5 * max_blocks].reshape(groups, 5, max_blocks)
    req = np.repeat(np.arange(5), n_sched)
    cu = np.cumsum(n_sched) - n_sched
    pos = start[req] + np.arange(n_sched.sum()) - np.repeat(cu, n_sched)
    slots = torch.from_numpy(slot_mapping(tables.astype(np.int32), req, pos, bs)).to(DEVICE)
    md = step_metadata(slots, tables, n_sched, start + n_sched, bs, DEVICE)
    return {
        "md": md,
        "slots": slots,
        "positions": torch.from_numpy(pos.astype(np.int32)).to(DEVICE),
        "input_ids": torch.from_numpy(rng.integers(0, 5, int(n_sched.sum())).astype(np.int32)),
        "n_sched": n_sched,
        "rows": rows,
        "unverified": unverified,
        "ks": ks,
    }


def _run(dd: DeviceDrafts, step: dict, rng_seed: int, lookup: bool) -> dict:
    """prepare, samples that often match the drafts, verify; everything it wrote."""
    ids = step["input_ids"].to(DEVICE)
    used, valid = dd.prepare(
        ids, step["positions"], step["md"], step["n_sched"], step["rows"], step["unverified"],
        step["ks"],
    )  # fmt: skip
    rng = np.random.default_rng(rng_seed)
    ks = step["ks"]
    samples = []
    for i, kk in enumerate(ks.tolist()):  # a sample equals its draft with probability 0.7
        d = used[i].cpu().tolist()
        samples += [d[j] if j < kk and rng.random() < 0.7 else int(rng.integers(0, 5))
                    for j in range(kk + 1)]  # fmt: skip
    samples_t = torch.tensor(samples, device=DEVICE)
    first = np.cumsum(ks + 1) - (ks + 1)
    seq = step["md"].seq_lens
    width = int(seq.max()) + 2
    bonus, found = dd.verify(samples_t, step["rows"], first, ks, np.arange(5), seq, used, valid,
                      width, lookup)  # fmt: skip
    ar = np.arange(dd.k)
    return {
        "positions": step["positions"].cpu(),
        "seq_lens": seq.cpu(),
        "slots": step["slots"].cpu(),
        "input_ids": ids.cpu(),
        "used": torch.where(torch.from_numpy(ar[None, :] < ks[:, None]), used.cpu(), 0),
        "valid": valid.bool().cpu(),
        "bonus": bonus.cpu(),
        "found": found.cpu(),
        "hist": dd.hist[:, : dd.dump].cpu(),
        "lens": dd.lens.cpu(),
        "accepted": dd.accepted.cpu(),
        "drafts": dd.drafts.cpu(),
        "num_valid": dd.num_valid.cpu(),
    }


def _case(seed: int, groups: int) -> tuple[DeviceDrafts, dict]:
    rng = np.random.default_rng(seed)
    k, min_n = int(rng.integers(1, 6)), int(rng.integers(1, 3))
    max_n = int(rng.integers(min_n, 5))
    dd = _state(rng, k, min_n, max_n)
    return dd, _step(rng, dd, groups)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_kernels_match_the_pytorch_path(seed: int, groups: int) -> None:
    lookup = seed != 5  # one case paused: the history only
    ref_dd, ref_step = _case(seed, groups)  # the same random state twice
    dd, step = _case(seed, groups)
    ref_dd.use_triton = False
    dd.use_triton = True
    want = _run(ref_dd, ref_step, seed, lookup)
    got = _run(dd, step, seed, lookup)
    assert want["accepted"].sum() > 0  # some drafts were accepted
    assert (ref_step["unverified"] > 0).any()  # some positions were corrected
    for key in want:
        assert torch.equal(got[key], want[key]), key

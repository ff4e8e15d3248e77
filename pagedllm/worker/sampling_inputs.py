"""Per-step SamplingMetadata from the InputBatch rows that sample."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedllm.sample.sampler import SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch, SamplingColumns


def build_sampling_metadata(
    ib: InputBatch,
    rows: np.ndarray,
    device: torch.device,
    generator: torch.Generator,
    eos_token_ids: set[int],
) -> SamplingMetadata:
    """Sampling metadata of InputBatch rows (see ``build_for_params``)."""
    out_pos = ib.num_tokens[rows] - ib.num_prompt_tokens[rows]
    return _build(
        ib.columns,
        rows,
        lambda i: ib.sampling_params[int(rows[i])],  # type: ignore[return-value]
        out_pos,
        lambda: [ib.prompt_ids(int(r)) for r in rows],
        lambda: [ib.output_ids(int(r)) for r in rows],
        device,
        generator,
        eos_token_ids,
    )


def build_for_params(
    params: list[SamplingParams],
    out_pos: list[int],
    prompt_ids: Callable[[], list[list[int]]],
    output_ids: Callable[[], list[list[int]]],
    device: torch.device,
    generator: torch.Generator,
    eos_token_ids: set[int],
) -> SamplingMetadata:
    """Metadata for rows given as a params list (the forks of parallel sampling)."""
    return _build(
        SamplingColumns.of(params),
        np.arange(len(params)),
        params.__getitem__,
        np.asarray(out_pos, dtype=np.int64),
        prompt_ids,
        output_ids,
        device,
        generator,
        eos_token_ids,
    )


def _build(
    columns: SamplingColumns,
    rows: np.ndarray,  # [B] rows of ``columns``
    param: Callable[[int], SamplingParams],  # i -> params of the i-th of ``rows``
    out_pos: np.ndarray,  # [B] index of the token each row samples in its output
    prompt_ids: Callable[[], list[list[int]]],
    output_ids: Callable[[], list[list[int]]],
    device: torch.device,
    generator: torch.Generator,
    eos_token_ids: set[int],
) -> SamplingMetadata:
    """Parameter columns are built only when some row needs them: an all-greedy batch makes
    no tensors at all (no host-to-device copies). Token lists for penalties are fetched only
    when some row uses penalties; the SamplingParams themselves only for the rows with a
    seed, a penalty or an active min_tokens."""
    values = columns.values[rows]  # [B, 4]
    all_greedy = bool(columns.greedy[rows].all())
    seeds: list[int | None] = [None] * len(rows)
    for i in np.flatnonzero(columns.seeded[rows]).tolist():
        seeds[i] = param(i).seed
    md = SamplingMetadata(
        temperature=torch.zeros(0),
        top_p=torch.zeros(0),
        top_k=torch.zeros(0, dtype=torch.int64),
        min_p=torch.zeros(0),
        seeds=seeds,
        output_positions=out_pos.tolist(),
        all_greedy=all_greedy,
        any_top_p=bool((values[:, 1] < 1.0).any()),
        any_top_k=bool((values[:, 2] > 0).any()),
        any_min_p=bool((values[:, 3] > 0.0).any()),
        generator=generator,
    )
    if not all_greedy:
        cols = torch.from_numpy(values).to(device, non_blocking=True)
        md.temperature, md.top_p, md.min_p = cols[:, 0], cols[:, 1], cols[:, 3]
        md.top_k = cols[:, 2].long()
    if columns.penalized[rows].any():
        params = [param(i) for i in range(len(rows))]
        pen = torch.tensor(
            [[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in params],
            dtype=torch.float32,
        ).to(device, non_blocking=True)
        md.presence, md.frequency, md.repetition = pen[:, 0], pen[:, 1], pen[:, 2]
        md.prompt_ids = prompt_ids()
        md.output_ids = output_ids()
    masks = []
    for i in np.flatnonzero(out_pos < columns.min_tokens[rows]).tolist():
        p = param(i)
        stop_ids = set(p.all_stop_token_ids)
        if not p.ignore_eos:
            stop_ids |= eos_token_ids
        if stop_ids:
            masks.append((i, sorted(stop_ids)))
    md.min_tokens_masks = masks or None
    md.max_num_logprobs = int(columns.logprobs[rows].max(initial=-1))
    return md

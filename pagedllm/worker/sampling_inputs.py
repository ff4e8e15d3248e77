"""Per-step SamplingMetadata from the InputBatch rows that sample."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedllm.sample.sampler import SamplingMetadata
from pagedllm.sampling_params import SamplingParams, SamplingType
from pagedllm.worker.input_batch import InputBatch


def build_sampling_metadata(
    ib: InputBatch,
    rows: np.ndarray,
    device: torch.device,
    generator: torch.Generator,
    eos_token_ids: set[int],
) -> SamplingMetadata:
    """Sampling metadata of InputBatch rows (see ``build_for_params``)."""
    params: list[SamplingParams] = [ib.sampling_params[int(r)] for r in rows]  # type: ignore[misc]
    out_pos = (ib.num_tokens[rows] - ib.num_prompt_tokens[rows]).tolist()
    return build_for_params(
        params,
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
    """Parameter columns are built only when some row needs them: an all-greedy batch makes
    no tensors at all (no host-to-device copies). Token lists for penalties are fetched only
    when some row uses penalties."""
    all_greedy = all(p.sampling_type == SamplingType.GREEDY for p in params)
    md = SamplingMetadata(
        temperature=torch.zeros(0),
        top_p=torch.zeros(0),
        top_k=torch.zeros(0, dtype=torch.int64),
        min_p=torch.zeros(0),
        seeds=[p.seed if p.sampling_type == SamplingType.RANDOM_SEED else None for p in params],
        output_positions=out_pos,
        all_greedy=all_greedy,
        any_top_p=any(p.top_p < 1.0 for p in params),
        any_top_k=any(p.top_k > 0 for p in params),
        any_min_p=any(p.min_p > 0.0 for p in params),
        generator=generator,
    )
    if not all_greedy:
        cols = torch.tensor(
            [[p.temperature, p.top_p, float(p.top_k), p.min_p] for p in params],
            dtype=torch.float32,
        ).to(device, non_blocking=True)
        md.temperature, md.top_p, md.min_p = cols[:, 0], cols[:, 1], cols[:, 3]
        md.top_k = cols[:, 2].long()
    if any(p.uses_penalties for p in params):
        pen = torch.tensor(
            [[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in params],
            dtype=torch.float32,
        ).to(device, non_blocking=True)
        md.presence, md.frequency, md.repetition = pen[:, 0], pen[:, 1], pen[:, 2]
        md.prompt_ids = prompt_ids()
        md.output_ids = output_ids()
    masks = []
    for i, p in enumerate(params):
        if out_pos[i] < p.min_tokens:
            stop_ids = set(p.all_stop_token_ids)
            if not p.ignore_eos:
                stop_ids |= eos_token_ids
            if stop_ids:
                masks.append((i, sorted(stop_ids)))
    md.min_tokens_masks = masks or None
    md.max_num_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=-1)
    return md

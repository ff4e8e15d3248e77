"""The model runner: turns a SchedulerOutput into one forward pass and sampled tokens."""

from __future__ import annotations

import logging

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import EngineConfig
from pagedllm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from pagedllm.model.loader import build_model
from pagedllm.sample.sampler import Sampler, SamplerOutput, SamplingMetadata
from pagedllm.sampling_params import SamplingType
from pagedllm.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 2 << 30  # like VLLM_CPU_KVCACHE_SPACE's order of magnitude


class ModelRunner:
    """Owns the model, the KV cache tensors and the persistent input batch of one device."""

    def __init__(self, config: EngineConfig, eos_token_ids: set[int] | None = None) -> None:
        self.config = config
        self.model_config = config.model_config
        self.cache_config = config.cache_config
        self.device = torch.device(config.device_config.device)
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.model_config.max_model_len
        self.eos_token_ids = eos_token_ids or set()
        torch.manual_seed(config.model_config.seed)
        self.generator = torch.Generator(device=self.device).manual_seed(config.model_config.seed)
        self.model = build_model(self.model_config, str(self.device))
        self.backend = self._make_backend()
        for layer in self.model.attention_layers():
            layer.backend = self.backend
        self.sampler = Sampler()
        self.input_batch = InputBatch(
            config.scheduler_config.max_num_seqs, self.max_model_len, self.block_size
        )
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0

    def _make_backend(self):  # noqa: ANN202
        from pagedllm.attention.backends.torch_native import TorchNativeBackend

        return TorchNativeBackend()

    # ------------------------------------------------------------------------ KV cache
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block across every layer: 2 (K, V) x block_size x kvh x head_dim."""
        layers = self.model.attention_layers()
        elem = torch.empty(0, dtype=self.model_config.torch_dtype).element_size()
        return sum(2 * self.block_size * a.num_kv_heads * a.head_dim * elem for a in layers)

    def determine_num_blocks(self) -> int:
        """How many blocks the KV cache gets: the override, the byte budget, or (CPU default)
        2 GiB capped at what max_num_seqs requests of max_model_len could ever use."""
        cc = self.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        per_block = self.kv_bytes_per_block()
        if cc.kv_cache_memory_bytes is not None:
            n = cc.kv_cache_memory_bytes // per_block
            if n < 1:
                raise ValueError(
                    f"kv_cache_memory_bytes={cc.kv_cache_memory_bytes} is smaller than one "
                    f"block ({per_block} bytes)."
                )
            return int(n)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * cc.gpu_memory_utilization) - used
            n = budget // per_block
            if n < 1:
                raise ValueError(
                    "no GPU memory left for the KV cache; raise gpu_memory_utilization"
                )
            return int(n)
        most = self.config.scheduler_config.max_num_seqs * (self.input_batch.max_blocks_per_req)
        return int(max(1, min(_CPU_DEFAULT_KV_BYTES // per_block, most)))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate [2, num_blocks, block_size, kvh, head_dim] per layer (zeroed) and bind it."""
        self.num_blocks = num_blocks
        self.kv_caches = []
        for layer in self.model.attention_layers():
            cache = torch.zeros(
                2,
                num_blocks,
                self.block_size,
                layer.num_kv_heads,
                layer.head_dim,
                dtype=self.model_config.torch_dtype,
                device=self.device,
            )
            layer.kv_cache = cache
            self.kv_caches.append(cache)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks,
            self.block_size,
            num_blocks * self.kv_bytes_per_block() / 2**20,
        )

    # ------------------------------------------------------------------------- the step
    def _update_states(self, so: SchedulerOutput) -> None:
        ib = self.input_batch
        for rid in so.finished_req_ids:
            ib.remove_request(rid)
        for new in so.scheduled_new_reqs:
            ib.add_request(new)
        for cached in so.scheduled_cached_reqs:
            row = ib.req_id_to_row[cached.req_id]
            if cached.new_block_ids:
                ib.append_blocks(row, cached.new_block_ids)
            ib.num_computed_tokens[row] = cached.num_computed_tokens

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: update request rows, build inputs, forward, sample, return tokens."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        ib = self.input_batch
        req_ids = list(so.num_scheduled_tokens.keys())
        rows = np.fromiter(
            (ib.req_id_to_row[r] for r in req_ids), dtype=np.int64, count=len(req_ids)
        )
        n_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        md, input_ids, positions = self._prepare_inputs(rows, n_sched)
        hidden = self.model(input_ids, positions, md)  # [num_tokens, hidden]

        seq_lens = md.seq_lens_np
        assert seq_lens is not None
        # Rows that reached the end of their known tokens sample the next one; a prefill
        # chunk that stops short of the prompt's end samples nothing.
        sample_mask = seq_lens == ib.num_tokens[rows]
        sample_idx = np.nonzero(sample_mask)[0]
        qsl = md.query_start_loc_np
        assert qsl is not None
        prompt_lp = self._prompt_logprobs(req_ids, rows, hidden, qsl, seq_lens)
        sampled_lists: list[list[int]] = [[] for _ in req_ids]
        logprobs: list | None = None
        if len(sample_idx) > 0:
            logits_idx = torch.from_numpy(qsl[sample_idx + 1] - 1).to(self.device)
            logits = self.model.compute_logits(hidden.index_select(0, logits_idx))
            smd = self._sampling_metadata(rows[sample_idx])
            out = self.sampler(logits, smd)
            tokens = out.sampled.tolist()
            for j, i in enumerate(sample_idx):
                ib.append_token(int(rows[i]), tokens[j])
                sampled_lists[i] = [tokens[j]]
            if smd.max_num_logprobs >= 0:
                logprobs = self._to_logprob_lists(out, sample_idx, len(req_ids), rows)
        ib.num_computed_tokens[rows] = seq_lens
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled_lists,
            logprobs=logprobs,
            prompt_logprobs=prompt_lp,
        )

    def _prepare_inputs(
        self, rows: np.ndarray, n_sched: np.ndarray
    ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        ib = self.input_batch
        bs = self.block_size
        cu = np.cumsum(n_sched)
        total = int(cu[-1])
        # Example: n_sched [2, 5, 3] -> req_idx [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
        #          offsets       [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]
        req_idx = np.repeat(np.arange(len(rows)), n_sched)
        offsets = np.arange(total) - np.repeat(cu - n_sched, n_sched)
        token_rows = rows[req_idx]
        positions = ib.num_computed_tokens[token_rows] + offsets
        input_ids = ib.token_ids[token_rows, positions]
        slots = ib.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = ib.num_computed_tokens[rows] + n_sched
        qsl = np.zeros(len(rows) + 1, dtype=np.int64)
        qsl[1:] = cu
        max_blocks = int(-(-seq_lens.max() // bs))
        block_tables = ib.block_table[rows, :max_blocks]
        dev = self.device
        md = AttentionMetadata(
            num_reqs=len(rows),
            num_actual_tokens=total,
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            block_tables=torch.from_numpy(np.ascontiguousarray(block_tables)).to(dev),
            max_query_len=int(n_sched.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=bs,
            query_start_loc_np=qsl,
            seq_lens_np=seq_lens,
        )
        md.plan["block_tables_np"] = block_tables
        return md, torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev)

    def _sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        ib = self.input_batch
        params = [ib.sampling_params[int(r)] for r in rows]
        assert all(p is not None for p in params)
        dev = self.device

        def col(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=dev)

        out_pos = (ib.num_tokens[rows] - ib.num_prompt_tokens[rows]).tolist()
        md = SamplingMetadata(
            temperature=col("temperature"),
            top_p=col("top_p"),
            top_k=col("top_k", torch.int64),
            min_p=col("min_p"),
            seeds=[p.seed if p.sampling_type == SamplingType.RANDOM_SEED else None for p in params],  # type: ignore[union-attr]
            output_positions=out_pos,
            all_greedy=all(p.sampling_type == SamplingType.GREEDY for p in params),  # type: ignore[union-attr]
            any_top_p=any(p.top_p < 1.0 for p in params),  # type: ignore[union-attr]
            any_top_k=any(p.top_k > 0 for p in params),  # type: ignore[union-attr]
            any_min_p=any(p.min_p > 0.0 for p in params),  # type: ignore[union-attr]
            generator=self.generator,
        )
        if any(p.uses_penalties for p in params):  # type: ignore[union-attr]
            md.presence = col("presence_penalty")
            md.frequency = col("frequency_penalty")
            md.repetition = col("repetition_penalty")
            md.prompt_ids = [ib.prompt_ids(int(r)) for r in rows]
            md.output_ids = [ib.output_ids(int(r)) for r in rows]
        masks = []
        for i, p in enumerate(params):
            assert p is not None
            if out_pos[i] < p.min_tokens:
                stop_ids = set(p.all_stop_token_ids)
                if not p.ignore_eos:
                    stop_ids |= self.eos_token_ids
                if stop_ids:
                    masks.append((i, sorted(stop_ids)))
        md.min_tokens_masks = masks or None
        md.max_num_logprobs = max(
            (p.logprobs for p in params if p is not None and p.logprobs is not None), default=-1
        )
        return md

    @staticmethod
    def _to_logprob_lists(
        out: SamplerOutput, sample_idx: np.ndarray, num_reqs: int, rows: np.ndarray
    ) -> list:
        assert out.logprob_ids is not None and out.logprobs is not None and out.ranks is not None
        ids, lps, ranks = out.logprob_ids.tolist(), out.logprobs.tolist(), out.ranks.tolist()
        result: list = [None] * num_reqs
        for j, i in enumerate(sample_idx):
            result[i] = [(ids[j], lps[j], ranks[j])]
        return result

    def _prompt_logprobs(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        hidden: torch.Tensor,
        qsl: np.ndarray,
        seq_lens: np.ndarray,
    ) -> dict:
        """Logprobs of prompt tokens 1.. (token p+1 predicted at position p), chunk by chunk."""
        ib = self.input_batch
        result: dict = {}
        for i, rid in enumerate(req_ids):
            row = int(rows[i])
            p = ib.sampling_params[row]
            if p is None or p.prompt_logprobs is None:
                continue
            start = int(seq_lens[i] - (qsl[i + 1] - qsl[i]))
            end = min(int(seq_lens[i]), int(ib.num_prompt_tokens[row]) - 1)
            if end <= start:
                continue
            h = hidden[int(qsl[i]) : int(qsl[i]) + (end - start)]
            lp = self.model.compute_logits(h).log_softmax(dim=-1)  # [n, vocab]
            targets = torch.from_numpy(ib.token_ids[row, start + 1 : end + 1]).to(lp.device)
            tgt_lp = lp.gather(1, targets[:, None])
            tgt_rank = (lp > tgt_lp).sum(-1, keepdim=True) + 1
            n = p.prompt_logprobs
            if n > 0:
                top_lp, top_ids = lp.topk(n, dim=-1)
                ids = torch.cat([targets[:, None], top_ids], 1).tolist()
                lps = torch.cat([tgt_lp, top_lp], 1).tolist()
                rk = torch.arange(1, n + 1).expand(len(targets), n)
                ranks = torch.cat([tgt_rank.cpu(), rk], 1).tolist()
            else:
                ids, lps, ranks = targets[:, None].tolist(), tgt_lp.tolist(), tgt_rank.tolist()
            result[rid] = (start + 1, list(zip(ids, lps, ranks)))
        return result

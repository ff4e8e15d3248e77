"""The model runner: turns a SchedulerOutput into one forward pass and sampled tokens."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedllm.attention.backends.base import AttentionBackend
from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheGroups,
    KVCacheSpec,
    SlidingWindowSpec,
    group_layers,
)
from pagedllm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed import expert_parallel
from pagedllm.distributed.parallel_state import dcp_info, ep_info, tp_info
from pagedllm.kv_layout import KVCacheLayout, kv_cache_dtype
from pagedllm.lora.worker import make_lora_worker
from pagedllm.model.loader import build_model
from pagedllm.sample.sampler import Sampler, SamplerOutput
from pagedllm.utils.pinned import copy_to_host
from pagedllm.worker.bitmask_rows import BitmaskApplier
from pagedllm.worker.cuda_graph import CUDAGraphRunner
from pagedllm.worker.device_drafts import DeviceDrafts
from pagedllm.worker.drafter import Drafter
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.inputs import InputPreparer, StepInputs
from pagedllm.worker.kv_connector import StepBatch, worker_roles
from pagedllm.worker.prompt_logprobs import prompt_logprobs
from pagedllm.worker.sample_plan import SamplePlan, plan_samples
from pagedllm.worker.sampling_inputs import build_sampling_metadata
from pagedllm.worker.ubatch import forward_overlapped, idle_overlapped

if TYPE_CHECKING:
    from pagedllm.structured_output.grammars import GrammarStep
    from pagedllm.worker.profiler import DeviceTimer

logger = logging.getLogger(__name__)


@dataclass
class LaunchedStep:
    """A step queued on the device; ``ModelRunner.resolve`` turns it into ModelRunnerOutput."""

    req_ids: list[str]
    prompt_logprobs: dict = field(default_factory=dict)
    # Which rows sample (batch indices), at which positions (several with draft tokens)
    plan: SamplePlan = field(
        default_factory=lambda: SamplePlan(np.zeros(0, np.int64), np.zeros(0, np.int64))
    )
    # Parallel sampling: [P] extra samples each sampling position drew (None: none)
    fork_counts: np.ndarray | None = None
    # The sampling rows' InputBatch rows, their epochs at launch and the positions their
    # (first) tokens fill; ``appended``: the runner counts the token (not beams).
    sample_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    sample_epochs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    sample_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    appended: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    # [S] rows whose next input is their token in ``sampled`` (the appended ones, and rows
    # whose samples the scheduler appends: drafts made on the device)
    feeds: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    # [num_sampling_rows] on the device: each row's newest token (its first sample; with
    # drafts made on the device, the sample after its accepted drafts)
    sampled: torch.Tensor | None = None
    want_logprobs: bool = False
    # sampled ids [P] (+ logprob ids, logprobs, ranks), then the forks' ids [F] (+ theirs), on
    # the host once ``event`` has completed
    host: list[torch.Tensor] = field(default_factory=list)
    event: Any = None
    timing: Any = None  # (start, end) CUDA events when a profiler times device work
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # batch rows
    selected: torch.Tensor | None = None  # [P, hidden] until launch_sample
    # structured requests: the sampling positions their bitmask rows mask, in
    # SchedulerOutput.structured_requests' order (one per request; 1 + k for one verifying k
    # drafts)
    structured_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # the first sampling position of each structured request (its reported token)
    structured_first: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # each KV connector's pending report (worker/kv_connector.py), by name
    kv_reports: dict = field(default_factory=dict)
    # a draft model: (SchedulerOutput.draft_requests, .scheduled_spec_tokens, [num_reqs] the
    # tokens computed after the step) of a step whose samples it drafts after
    drafting: Any = None
    # drafts made on the device: (the step's sequence lengths on the device [num_reqs], their
    # host bound [num_reqs], the drafts verified [num_reqs, k], their valid mask [num_reqs,
    # k], the drafts each row verifies [num_reqs], paused), then after the copy to the host:
    # (drafts per row, each sampling row's new lookup's count, drafts, valid)
    device_drafts: Any = None

    @classmethod
    def nothing(cls) -> LaunchedStep:
        return cls(req_ids=[])


_CPU_DEFAULT_KV_BYTES = 2 << 30  # the order of VLLM_CPU_KVCACHE_SPACE's default


def make_backend(device: torch.device) -> AttentionBackend:
    """Triton kernels on a GPU, torch ops on the CPU."""
    if device.type == "cuda":
        from pagedllm.attention.backends.triton_backend import TritonBackend

        return TritonBackend()
    from pagedllm.attention.backends.torch_native import TorchNativeBackend

    return TorchNativeBackend()


class ModelRunner:
    """Owns the model, the KV cache tensors, the persistent input batch and (on a GPU) the
    CUDA graphs of one device."""

    def __init__(self, config: EngineConfig, eos_token_ids: set[int] | None = None) -> None:
        self.config = config
        self.model_config = config.model_config
        self.cache_config = config.cache_config
        self.device = torch.device(config.device_config.device)
        self.dcp = dcp_info()  # decode context parallelism: a table's block spans dcp pages
        self.block_size = config.cache_config.block_size * self.dcp[1]
        self.max_model_len = config.model_config.max_model_len
        self.max_num_tokens = config.scheduler_config.max_num_batched_tokens
        self.eos_token_ids = eos_token_ids or set()
        torch.manual_seed(config.model_config.seed)
        self.generator = torch.Generator(device=self.device).manual_seed(config.model_config.seed)
        # expert parallelism over data-parallel cores: join the cores' MoE group (or nothing)
        expert_parallel.join_from_config(config.parallel_config, self.device.type)
        self.model = build_model(self.model_config, str(self.device))
        # KV connectors' worker roles (worker/kv_connector.py); one may own the KV layout
        roles = worker_roles(config.kv_connector_names)
        layout_role = next((r for r in roles if r.owns_layout), None)
        self.backend = (
            layout_role.make_backend(self.device) if layout_role else make_backend(self.device)
        )
        for layer in self.model.attention_layers():
            layer.backend = self.backend
        self.drafter: Drafter | None = None  # speculative decoding with a draft model
        if config.draft_model_config is not None:
            self.drafter = Drafter(config.draft_model_config, self.device, self.backend)
        # the model's dtype, or float8 e4m3 (kv_cache_dtype fp8: see kv_layout.py)
        self.kv_dtype = kv_cache_dtype(config.cache_config.fp8, self.model_config, self.device)
        elem = torch.empty(0, dtype=self.kv_dtype).element_size()
        self.kv_groups = (
            layout_role.kv_groups(self.model.attention_layers(), self.block_size, elem)
            if layout_role
            else self._group_kv_layers(elem)
        )
        self.input_batch = InputBatch(
            config.scheduler_config.max_num_seqs,
            self.max_model_len,
            self.block_size,
            self.kv_groups.num_groups,
        )
        self.connectors = [role.for_runner(self) for role in roles]
        self._connector_of = {c.name: c for c in self.connectors}
        self.kv_layout: Any = next((c for c in self.connectors if c.owns_layout), None)
        if self.kv_layout is None:
            calibrate = config.cache_config.calculate_kv_scales
            self.kv_layout = KVCacheLayout(self.kv_groups, self.kv_dtype, self.device, calibrate)
        self.kv_layout.bind(self._attention_layers())
        self.sampler = Sampler()
        spec = config.speculative_config
        # ngram_gpu: the lookup, its token histories and the verification on the device
        self.device_drafts: DeviceDrafts | None = None
        if spec is not None and spec.method == "ngram_gpu":
            self.device_drafts = DeviceDrafts(
                config.scheduler_config.max_num_seqs,
                self.max_model_len,
                spec.num_speculative_tokens,
                int(spec.prompt_lookup_min),  # type: ignore[arg-type]
                int(spec.prompt_lookup_max),  # type: ignore[arg-type]
                self.device,
            )
        self.inputs = InputPreparer(self.input_batch, self.max_num_tokens, self.device, self.dcp)
        self.lora = make_lora_worker(config, self.model, self.inputs)  # None without LoRA
        self.graph_runner: CUDAGraphRunner | None = None
        self._unresolved: LaunchedStep | None = None  # the last launched step, until resolved
        self.bitmask = BitmaskApplier(self.device, self.input_batch.max_num_reqs)
        self.tp_size = tp_info()[1]  # this process's tensor-parallel group (1: none)
        self.profiler: DeviceTimer | None = None  # a benchmark's hook (worker/profiler.py)

    # ------------------------------------------------------------------------ KV cache
    def _attention_layers(self) -> list[torch.nn.Module]:
        """Every layer with a KV cache: the model's, then a draft model's (worker/drafter.py)."""
        layers = self.model.attention_layers()
        if self.drafter is not None:
            layers = layers + self.drafter.attention_layers()
        return layers

    def _group_kv_layers(self, elem: int) -> KVCacheGroups:
        specs: list[KVCacheSpec] = []
        for a in self._attention_layers():
            shape = (self.block_size, a.num_kv_heads, a.head_dim, elem, self.dcp[1])
            if a.sliding_window:
                specs.append(SlidingWindowSpec(*shape, sliding_window=int(a.sliding_window)))
            else:
                specs.append(FullAttentionSpec(*shape))
        return group_layers(specs, hybrid=not self.cache_config.disable_hybrid_kv_cache_manager)

    def kv_cache_groups(self) -> KVCacheGroups:
        """How the model's layers share block tables (what the KV manager is built for)."""
        return self.kv_groups

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """The KV cache tensors (one per layer of a group; see pagedllm/kv_layout.py)."""
        return self.kv_layout.tensors

    @property
    def num_blocks(self) -> int:
        return self.kv_layout.num_blocks

    def kv_bytes_per_block(self) -> int:
        """Bytes one block id stands for, across every cache tensor (K and V)."""
        return self.kv_layout.block_bytes

    def _blocks_per_request(self) -> int:
        """Blocks a max_model_len request holds at most, over every group's table."""
        return self.kv_layout.blocks_per_request(
            self.max_model_len, self.max_num_tokens, self.input_batch.max_blocks_per_req
        )

    def _max_useful_blocks(self) -> int:
        """Blocks max_num_seqs full-length requests could ever hold (+ a null block)."""
        per_req = self._blocks_per_request()
        return self.config.scheduler_config.max_num_seqs * per_req + int(self.kv_groups.is_hybrid)

    def determine_num_blocks(self) -> int:
        """How many blocks the KV cache gets: the override; else the byte budget; else on a GPU
        ``gpu_memory_utilization`` x total memory minus the peak of a profiling forward pass at
        the largest batch; else (CPU) 2 GiB, capped at what max_num_seqs full-length requests
        could ever use."""
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
        # No more blocks than max_num_seqs full-length requests could ever hold.
        most = self._max_useful_blocks()
        if self.device.type == "cuda":
            return min(self._profile_gpu_blocks(per_block), most)
        return int(max(1, min(_CPU_DEFAULT_KV_BYTES // per_block, most)))

    @torch.inference_mode()
    def _profile_gpu_blocks(self, per_block: int) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        ib = self.input_batch
        # the largest step: the token budget, but no more than max_num_seqs full requests hold
        num_tokens = min(self.max_num_tokens, ib.max_num_reqs * self.max_model_len)
        blocks = -(-num_tokens // self.block_size)
        self.initialize_kv_cache(blocks, log=False)  # temporary, for the profiling pass
        temp_bytes = blocks * per_block
        self._dummy_run(num_tokens, blocks)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - temp_bytes
        self._release_kv_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * self.cache_config.gpu_memory_utilization) - peak - max(non_torch, 0)
        n = budget // per_block
        logger.info(
            "memory profile: total %.1f GiB, peak %.2f GiB, non-torch %.2f GiB, KV budget %.2f GiB",
            total / 2**30,
            peak / 2**30,
            non_torch / 2**30,
            budget / 2**30,
        )
        if n < 1:
            raise ValueError(
                "no GPU memory left for the KV cache after the profiling run; raise "
                "gpu_memory_utilization or lower max_num_batched_tokens"
            )
        return int(n)

    def _dummy_run(self, num_tokens: int, num_blocks: int) -> None:
        """A forward pass over ``num_tokens`` prompt tokens (split into max_model_len-long
        requests) plus the logits and sampler of max_num_seqs rows: the activation peak."""
        ib = self.input_batch
        num_reqs = min(ib.max_num_reqs, -(-num_tokens // self.max_model_len))
        n_sched = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
        n_sched[: num_tokens % num_reqs] += 1
        rows = np.arange(num_reqs)
        saved = (ib.num_computed_tokens[rows].copy(), ib.block_table[:, rows].copy())
        ib.num_computed_tokens[rows] = 0
        nb = -(-int(n_sched.max()) // self.block_size)
        ib.block_table[:, rows, :nb] = np.arange(nb) % num_blocks
        inputs = self.inputs.prepare(rows, n_sched)
        if expert_parallel.dp_ep_info()[1] > 1:  # every core profiles the same pass at once
            expert_parallel.set_step_tokens([num_tokens] * expert_parallel.dp_ep_info()[1])
        self.kv_layout.begin_dummy(inputs, rows, n_sched, num_blocks)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
        if self.drafter is not None:
            self.drafter.mirror(inputs)
        self.kv_layout.end_dummy(num_reqs)
        n_logits = min(ib.max_num_reqs, num_tokens)
        logits = self.model.compute_logits(hidden[:n_logits])
        logits.softmax(-1).argmax(-1)
        ib.num_computed_tokens[rows], ib.block_table[:, rows] = saved

    def initialize_kv_cache(self, num_blocks: int, log: bool = True) -> None:
        """Allocate the cache tensors (zeroed; see pagedllm/kv_layout.py) and bind them."""
        self.kv_layout.allocate(num_blocks)
        self.kv_layout.bind(self._attention_layers())
        if log:
            per_req = self._blocks_per_request()
            logger.info(
                "KV cache: %d blocks x %d tokens (%.2f GiB), %d group(s) of %d layer(s); max "
                "concurrency at max_model_len %d: %.1fx",
                num_blocks,
                self.block_size,
                num_blocks * self.kv_bytes_per_block() / 2**30,
                self.kv_groups.num_groups,
                self.kv_groups.layers_per_group,
                self.max_model_len,
                num_blocks / per_req,
            )

    def initialize_swap_space(self) -> int:
        """Allocate host blocks for swap preemption (pinned when the device is a GPU);
        returns their number."""
        per_block = self.kv_bytes_per_block()
        n = self.cache_config.swap_space_bytes // per_block
        self.kv_layout.allocate_host(n)
        if n <= 0:
            return 0
        logger.info("swap space: %d host blocks (%.2f GiB)", n, n * per_block / 2**30)
        return int(n)

    def swap_is_cheaper(self) -> bool:
        """The 'auto' preemption rule: moving a token's KV out and back over the host link
        costs less than recomputing it (2 x params FLOPs). Rough device constants: a GPU
        ~25 GB/s host link and ~400 TFLOP/s; a CPU ~10 GB/s memcpy and ~100 GFLOP/s."""
        per_token = self.kv_bytes_per_block() / self.block_size
        params = sum(p.numel() for p in self.model.parameters())
        host_bw, flops = (25e9, 4e14) if self.device.type == "cuda" else (1e10, 1e11)
        return 2 * per_token / host_bw < 2 * params / flops

    def _release_kv_cache(self) -> None:
        self.kv_layout.release()
        self.kv_layout.bind(self._attention_layers())
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def capture_cuda_graphs(self) -> None:
        """Capture decode graphs (GPU only, unless enforce_eager); a layout with graphs of its
        own (``KVCacheLayout.capture_graphs``) captures those instead."""
        if self.device.type != "cuda" or self.kv_layout.capture_graphs(self):
            return
        if self.config.device_config.enforce_eager:
            return
        shape = dict(
            max_bs=self.input_batch.max_num_reqs,
            max_blocks_per_req=self.input_batch.max_blocks_per_req,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            device=self.device,
            num_kv_groups=self.kv_groups.num_groups,
        )
        spec = self.config.speculative_config
        if spec is not None:  # verification steps: rows of a token and its k drafts
            shape["query_lens"] = (1, spec.num_speculative_tokens + 1)
        self.graph_runner = CUDAGraphRunner(self.model, **shape)
        self.graph_runner.capture()
        if self.drafter is not None:  # its first pass after a verification: up to k + 2
            if spec is not None:
                shape["query_lens"] = (1, spec.num_speculative_tokens + 2)
            self.drafter.capture_cuda_graphs(**shape)

    # ------------------------------------------------------------------------- the step
    def reset_requests(self) -> None:
        """Forget every request and any launched step (after a step failed part-way: its rows
        may be half-updated, and the scheduler sends every surviving request anew). The KV
        cache, the CUDA graphs and the buffers stay."""
        ib = self.input_batch
        for rid in list(ib.req_id_to_row):
            ib.remove_request(rid)
        self._unresolved = None

    @torch.inference_mode()
    def execute_dp_idle(self, counts: list[int], ubatches: Any = None) -> None:
        """Expert parallelism over data-parallel cores: this core has no tokens this step,
        another has ``counts``: each MoE layer's exchange, with zero rows of this core's
        (``MoEWeights.dp_idle_forward``; twice, overlapped, with ``ubatches``: the
        micro-batches' counts). No attention, no KV cache, no sampling."""
        if ubatches:
            return idle_overlapped(self.model, ubatches)
        expert_parallel.set_step_tokens(counts)
        self.model.dp_idle_forward()

    def expert_load(self) -> list[list[int]] | None:
        """The (token, expert) pairs each expert computed here since the last call, per MoE
        layer ``[layers][E]`` (waits for the device); None for a dense model. Without expert
        parallelism every tensor-parallel rank computes every pair: rank 0 alone counts."""
        take = getattr(self.model, "take_expert_load", None)
        counts_here = ep_info()[1] > 1 or tp_info()[0] == 0
        return None if take is None else (take().cpu() * counts_here).tolist()  # [layers, E]

    def _update_states(self, so: SchedulerOutput) -> None:
        ib = self.input_batch
        for rid in so.finished_req_ids:
            ib.remove_request(rid)
        rows = self.kv_layout.add_rows(ib, so.scheduled_new_reqs, so)
        dd = self.device_drafts
        if dd is not None and rows:
            dd.add_rows(rows, [ib.token_ids[r, : ib.num_tokens[r]] for r in rows])
        self.kv_layout.update_rows(ib, so.cached_rows())

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        md = inputs.metadata
        gr = self.graph_runner
        if gr is not None and gr.can_run(md.num_reqs, md.max_query_len):
            return gr.run(inputs.input_ids, inputs.positions, md)
        self.kv_layout.finish_metadata(md)
        return self.model(inputs.input_ids, inputs.positions, md)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run a step without structured requests to the end: launch it and wait for its
        tokens. (A step with grammars is ``launch_forward``, then ``launch_sample`` with the
        bitmask the engine core gets from its ``Grammars``, then ``resolve``.)"""
        assert not so.structured_requests, "a grammar step needs its bitmask"
        step = self.launch_forward(so)
        self.launch_sample(step, None)
        return self.resolve(step)

    @torch.inference_mode()
    def launch_forward(self, so: SchedulerOutput) -> LaunchedStep:
        """Queue the first half of a step: update request rows, build inputs, forward.

        Returns without waiting for the device; ``launch_sample`` queues the sampling and
        ``resolve`` brings the tokens to the host. Under async scheduling the next step is
        launched before this one is resolved: a row whose next input is the token this step
        samples reads it from ``LaunchedStep.sampled`` on the device, and the row counts it
        (``InputBatch.num_tokens``) from ``launch_sample`` on.
        """
        self.kv_layout.swap(so.blocks_to_swap_out, so.blocks_to_swap_in)
        self.kv_layout.copy_blocks(so.blocks_to_copy)
        self._update_states(so)
        if so.dp_step_tokens:
            expert_parallel.set_step_tokens(so.dp_step_tokens)
        if so.total_num_scheduled_tokens == 0:
            step = LaunchedStep.nothing()
            self._after_forward(so, step)
            return step
        ib = self.input_batch
        req_ids = list(so.num_scheduled_tokens.keys())
        rows = np.fromiter((ib.req_id_to_row[r] for r in req_ids), np.int64, len(req_ids))
        n_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        dd = self.device_drafts
        unverified = None
        if dd is not None:
            unverified = self._device_draft_rows(so, rows)
        seq_lens = ib.num_computed_tokens[rows] + n_sched
        cu = np.cumsum(n_sched)
        # the rows that sample and their logits' token indices (see worker/sample_plan.py)
        always = dd.sched_appends[rows] if dd is not None else None
        plan = plan_samples(ib, so.scheduled_spec_tokens, req_ids, rows, seq_lens, cu, always)
        sample_idx, logits_idx = plan.sample_idx, plan.logits_idx
        dst, src = self._inputs_from_last_step(rows, cu - n_sched)
        inputs = self.inputs.prepare(rows, n_sched, (logits_idx, dst, src))
        logits_idx_t, dst_t, src_t = inputs.extra
        if self.connectors:
            batch = StepBatch(rows, n_sched, inputs.positions, inputs.metadata, plan.sample_idx)
            meta = so.kv_connector_metadata
            for c in self.connectors:
                c.before_forward(so, meta.get(c.name), batch)
        if len(dst):
            prev = self._unresolved
            assert prev is not None and prev.sampled is not None
            inputs.input_ids[dst_t.long()] = prev.sampled[src_t.long()].to(inputs.input_ids.dtype)
        dd_state = None
        if dd is not None:
            assert unverified is not None
            dd_state = self._device_draft_inputs(so, inputs, rows, n_sched, unverified)
        timing = self.profiler.begin_step() if self.profiler is not None else None
        ub = so.dp_ubatch_tokens  # dual-batch overlap (worker/ubatch.py)
        hidden = forward_overlapped(self, rows, n_sched, ub) if ub else self._forward(inputs)
        if self.drafter is not None and not so.spec_paused:
            self._mirror(so, rows, n_sched, seq_lens, inputs)  # the draft model's KVs
        qsl = inputs.metadata.query_start_loc_np
        assert qsl is not None
        prompt_lp = prompt_logprobs(self.model, ib, req_ids, rows, hidden, qsl, seq_lens)
        step = LaunchedStep(req_ids=req_ids, prompt_logprobs=prompt_lp)
        step.rows, step.plan, step.timing = rows, plan, timing
        if dd_state is not None:
            step.device_drafts = (inputs.metadata.seq_lens, seq_lens, *dd_state, so.spec_paused)
        if so.draft_requests:
            step.drafting = (so.draft_requests, so.scheduled_spec_tokens, seq_lens)
        if so.structured_batch_idx:
            # sample_idx is ascending: e.g. sampling batch indices [0, 2, 3], structured
            # batch indices [2, 3] -> sampling rows [1, 2] (with drafts: their first samples)
            step.structured_rows = np.searchsorted(sample_idx, so.structured_batch_idx)
            step.structured_first = step.structured_rows
            if plan.num_samples is not None:
                # with drafts, a mask row per sampling position (structured_output/matchers.py
                # fills 1 + k rows for a request with k drafts): e.g. first [0, 3], samples
                # [3, 1] -> rows [0, 1, 2, 3]; the tokens reported are the first samples
                sel = step.structured_rows
                first, counts = plan.first[sel], plan.num_samples[sel]
                step.structured_first = first
                starts = np.repeat(np.cumsum(counts) - counts, counts)
                step.structured_rows = np.repeat(first, counts) + np.arange(len(starts)) - starts
        if len(sample_idx) > 0:
            if len(logits_idx) == inputs.metadata.num_actual_tokens:
                step.selected = hidden[: len(logits_idx)]  # every token samples (pure decode)
            else:
                step.selected = hidden.index_select(0, logits_idx_t.long())
        ib.num_computed_tokens[rows] = seq_lens
        self._after_forward(so, step)
        return step

    def _after_forward(self, so: SchedulerOutput, step: LaunchedStep) -> None:
        """The KV connectors' work after the forward pass (its attention scores count)."""
        meta = so.kv_connector_metadata
        for c in self.connectors:
            pending = c.after_forward(so, meta.get(c.name))
            if pending is not None:
                step.kv_reports[c.name] = pending

    @torch.inference_mode()
    def launch_sample(self, step: LaunchedStep, bitmask: GrammarStep | None) -> None:
        """Queue the second half of a step: logits, the grammar ``bitmask`` of the step's
        structured requests (filled on the host while the forward ran), sampling, and the
        copy of the results to the host."""
        ib = self.input_batch
        if step.selected is not None:
            plan = step.plan
            if bitmask is not None and bitmask.mask is None:
                bitmask = None
            sample_rows = step.rows[plan.sample_idx]
            smd = build_sampling_metadata(
                ib, sample_rows, self.device, self.generator, self.eos_token_ids, plan.drafts
            )
            greedy = None
            if (
                self.tp_size > 1
                and bitmask is None
                and smd.argmax_only
                and smd.fork_src is None
                and plan.drafts is None
            ):  # each rank's argmax, not the gathered vocabulary (LMHead.argmax)
                greedy = self.model.greedy_tokens(step.selected)  # [P]
            if greedy is not None:
                out = SamplerOutput(sampled=greedy)
            else:
                float32 = bitmask is not None or not smd.argmax_only
                logits = self.model.compute_logits(step.selected, float32=float32)  # [P, vocab]
                if bitmask is not None:
                    self.bitmask.apply(logits, bitmask, step.structured_rows)
                out = self.sampler(logits, smd)
            step.selected = None
            step.sample_rows = sample_rows
            step.sample_epochs = ib.epoch[sample_rows]
            step.sample_pos = ib.num_tokens[sample_rows]
            step.appended = ~ib.external[sample_rows]  # beam search: the scheduler appends
            step.feeds = step.appended
            dd = self.device_drafts
            if dd is not None:  # drafts made on the device: the scheduler appends
                step.feeds = step.appended | dd.sched_appends[sample_rows]
                step.appended = step.appended & ~dd.sched_appends[sample_rows]
            ib.num_tokens[sample_rows[step.appended]] += 1
            first = plan.first
            extra: list[torch.Tensor] = []
            if dd is not None:
                step.sampled, extra = self._verify_device_drafts(step, out.sampled)
            elif first is None:
                step.sampled = out.sampled
            else:  # a row with drafts commits its first sample (see worker/sample_plan.py)
                step.sampled = out.sampled[torch.from_numpy(first).to(self.device)]
            step.want_logprobs = smd.max_num_logprobs >= 0
            results = [out.sampled]
            if step.want_logprobs:
                results += out.logprob_tensors()
            if out.forks is not None:
                step.fork_counts = smd.fork_counts
                results.append(out.forks.sampled)
                if step.want_logprobs:
                    results += out.forks.logprob_tensors()
            step.host, step.event = copy_to_host(results + extra)
            if extra:  # the lookups' counts, then the verified drafts (if any)
                step.host, dd_host = step.host[: len(results)], step.host[len(results) :]
                found = dd_host[0]
                used, valid = dd_host[1:] if len(dd_host) == 3 else (None, None)
                step.device_drafts = (step.device_drafts[4], found, used, valid)
        if step.timing is not None:
            step.timing = self.profiler.end(step.timing)  # type: ignore[union-attr]
        self._unresolved = step

    def resolve(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step's tokens and hand them to the scheduler; writes each
        token into its row unless the row has been given to another request since."""
        if self._unresolved is step:
            self._unresolved = None
        if step.event is not None:
            step.event.synchronize()
        if step.timing is not None and self.profiler is not None:
            self.profiler.step_resolved(step.timing)  # (its end: just after ``event``)
        num_reqs = len(step.req_ids)
        sampled_lists: list[list[int]] = [[] for _ in step.req_ids]
        logprobs = None
        structured_tokens = None
        forked: tuple[dict, dict] = ({}, {})
        if step.host:
            ib, plan = self.input_batch, step.plan
            tokens_np = step.host[0].numpy()  # [P]
            first = plan.first
            committed = tokens_np if first is None else tokens_np[first]  # [S]
            rows, pos = step.sample_rows, step.sample_pos
            ok = step.appended & (ib.epoch[rows] == step.sample_epochs) & (pos < ib.max_model_len)
            ib.token_ids[rows[ok], pos[ok]] = committed[ok]
            sampled_lists = plan.token_lists(tokens_np, num_reqs)
            if len(step.structured_first):
                structured_tokens = tokens_np[step.structured_first].tolist()
            n = 4 if step.want_logprobs else 1  # host tensors per sampler output
            if step.want_logprobs:
                logprobs = plan.logprob_lists(step.host[1:n], num_reqs)
            if step.fork_counts is not None:
                fork_lp = step.host[n + 1 : 2 * n] if step.want_logprobs else None
                forked = plan.fork_lists(
                    step.req_ids, step.fork_counts, step.host[n].numpy(), fork_lp
                )
        drafts = {}
        if step.drafting is not None and step.host:
            drafts = self._propose_drafts(step, sampled_lists)
        device_draft_tokens: dict[str, list[int]] = {}
        device_draft_found: dict[str, int] = {}
        if step.device_drafts is not None and step.host and len(step.device_drafts) == 4:
            # [num_reqs] drafts verified, [S] found next, [num_reqs, k] drafts and valid mask
            ks, found, used, valid = step.device_drafts
            ids = step.req_ids
            for i, n in zip(step.plan.sample_idx.tolist(), found.tolist()):
                device_draft_found[ids[i]] = n
            if used is not None:
                batch = np.flatnonzero(ks)
                for i, d, v in zip(batch.tolist(), used[batch].tolist(), valid[batch].tolist()):
                    device_draft_tokens[ids[i]] = [t for t, ok in zip(d, v) if ok]
        reports = {name: self._connector_of[name].finish(p) for name, p in step.kv_reports.items()}
        return ModelRunnerOutput(
            kv_connector_output=reports,
            req_ids=step.req_ids,
            sampled_token_ids=sampled_lists,
            logprobs=logprobs,
            prompt_logprobs=step.prompt_logprobs,
            forked_token_ids=forked[0],
            forked_logprobs=forked[1],
            structured_tokens=structured_tokens,
            draft_token_ids=drafts,
            device_draft_tokens=device_draft_tokens,
            device_draft_found=device_draft_found,
        )

    def _mirror(self, so: SchedulerOutput, rows: np.ndarray, n_sched: np.ndarray,
                seq_lens: np.ndarray, inputs: StepInputs) -> None:  # fmt: skip
        """The draft model's KVs for the step's tokens, at the target's slots, in one pass
        queued behind the target's (see worker/drafter.py).

        - A decode or verification row that drafts after the step (``so.draft_requests``)
          and whose draft KVs are complete is left out: the draft's first pass after the
          samples computes its KVs together with the new token (``Drafter.propose``).
        - A row whose draft KVs lag (steps skipped under load, or a left-out row that did not
          draft) starts at its first missing position; all rows together stay within the
          step's token budget (a row cut short catches up at its next steps, without drafts).

        Example (budget 64): row A, a prefill chunk at 100..131 with draft KVs up to 100: 32
        tokens from 100; row B, 200 computed, draft KVs up to 160, one decode token at 200:
        positions 160..200, 41 tokens, of which 32 fit (160..191; draft_computed 192).
        """
        assert self.drafter is not None
        ib = self.input_batch
        before = seq_lens - n_sched  # computed before this step
        done = ib.draft_computed[rows]
        # rejected drafts leave done past before: the step rewrites those positions
        start = np.minimum(done, before)
        mirror = np.ones(len(rows), dtype=bool)
        if so.draft_requests:
            spec = so.scheduled_spec_tokens
            for i, rid in enumerate(so.num_scheduled_tokens):
                if (rid in so.draft_requests and start[i] == before[i]
                        and n_sched[i] == 1 + len(spec.get(rid, ()))):  # fmt: skip
                    mirror[i] = False
        if not mirror.any():
            return
        want = np.where(mirror, seq_lens - start, 0)
        if mirror.all() and (start == before).all():
            self.drafter.mirror(inputs)  # the step's own inputs: nothing lags
            ib.draft_computed[rows] = seq_lens
            return
        # Example: want [32, 41], budget 64 -> ends [32, 64] -> take [32, 32]
        take = np.diff(np.minimum(np.cumsum(want), self.max_num_tokens), prepend=0)
        sel = take > 0
        sel_rows, n = rows[sel], take[sel]
        saved = ib.num_computed_tokens[sel_rows].copy()
        ib.num_computed_tokens[sel_rows] = start[sel]
        try:
            own = self.inputs.prepare(sel_rows, n)
        finally:
            ib.num_computed_tokens[sel_rows] = saved
        self.drafter.mirror(own)
        ib.draft_computed[sel_rows] = start[sel] + n

    def _propose_drafts(
        self, step: LaunchedStep, sampled: list[list[int]]
    ) -> dict[str, tuple[int, list[int]]]:
        """The draft model's drafts after each drafting request's newest token (see
        worker/drafter.py): request -> (its known tokens, the drafts)."""
        assert self.drafter is not None
        wanted, verified, seq_lens = step.drafting
        ib = self.input_batch
        ids: list[str] = []
        rows, positions, tokens, num, starts = [], [], [], [], []
        k = self.config.speculative_config.num_speculative_tokens
        for i, rid in enumerate(step.req_ids):
            samples = sampled[i]
            look = wanted.get(rid, 0)
            if not samples or not look:
                continue
            drafts = verified.get(rid, ())
            a = 0  # drafts accepted, as the scheduler will count them (core/sched/spec.py)
            while a < len(drafts) and samples[a] == drafts[a]:
                a += 1
            # Example: 10 known tokens, drafts [5, 9, 2] -> 13 computed; samples [5, 9, 7, 4]
            # -> a = 2, the newest token 7 at position 13 - 3 + 2 = 12
            q = int(seq_lens[i]) - len(drafts) + a
            n = min(look, self.max_model_len - 1 - q)
            row = int(step.rows[i])
            # the first pass computes the draft KVs from the first missing position to q:
            # e.g. a verification of [t, d1..d4] at P..P+4 (left out of the mirror, draft KVs
            # up to P) with 2 accepted -> positions P..P+3 (t, d1, d2 and the new token)
            first = min(int(ib.draft_computed[row]), q)
            if n < 1 or q - first + 1 > k + 2:  # still catching up (the mirror does it)
                continue
            ids.append(rid)
            rows.append(row)
            positions.append(q)
            tokens.append(samples[a])
            num.append(n)
            starts.append(first)
        if not ids:
            return {}
        rows_np, pos_np = np.array(rows, dtype=np.int64), np.array(positions, dtype=np.int64)
        out = self.drafter.propose(
            ib, self.inputs, rows_np, pos_np, np.array(tokens, dtype=np.int64),
            np.array(num, dtype=np.int64), np.array(starts, dtype=np.int64),
        )  # fmt: skip
        ib.draft_computed[rows_np] = pos_np + 1  # the new token's; the drafts' are unverified
        return {rid: (q + 1, d) for rid, q, d in zip(ids, positions, out)}

    def _inputs_from_last_step(
        self, rows: np.ndarray, first_token: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows whose first input token was sampled by the unresolved previous step: where it
        goes in this step's flat input ids (dst) and where it is in that step's sampled tokens
        (src). Example: last step sampled rows [4, 9] (src 0, 1); this step runs rows [9, 2, 4]
        with first tokens at [0, 1, 6] -> dst [0, 6], src [1, 0]."""
        prev = self._unresolved
        empty = np.zeros(0, dtype=np.int64)
        if prev is None or prev.sampled is None:
            return empty, empty
        ib = self.input_batch
        live = prev.feeds & (ib.epoch[prev.sample_rows] == prev.sample_epochs)
        src_of_row = np.full(ib.max_num_reqs, -1, dtype=np.int64)
        src_of_row[prev.sample_rows[live]] = np.nonzero(live)[0]
        src = src_of_row[rows]
        has = src >= 0
        # such a row computes exactly the position the previous step sampled (a row with
        # drafts made on the device: the runner's host counts lag; the device knows)
        counted = has.copy()
        counted[has] = prev.appended[src[has]]
        assert np.array_equal(
            ib.num_computed_tokens[rows[counted]], prev.sample_pos[src[counted]]
        ), "a row reads a token from the last step at the wrong position"
        return first_token[has], src[has]

    def _device_draft_rows(self, so: SchedulerOutput, rows: np.ndarray) -> np.ndarray:
        """Drafts made on the device, before the step's inputs: mark the rows that verify
        them (the scheduler appends their samples from now on) and return each row's
        unverified drafts ([num_reqs]: those of its unresolved last step, counted by the host
        as accepted; ``DeviceDrafts.prepare`` corrects them on the device). On a CPU (the last
        step is done when it returns) the host's computed counts are corrected here instead,
        and zeros returned."""
        dd, ib = self.device_drafts, self.input_batch
        assert dd is not None
        for rid in so.scheduled_spec_tokens:
            dd.sched_appends[ib.req_id_to_row[rid]] = True
        unverified = so.spec_unverified
        num = len(rows)
        if not unverified:
            return np.zeros(num, dtype=np.int64)
        unv = np.fromiter(
            (unverified.get(r, 0) for r in so.num_scheduled_tokens), dtype=np.int64, count=num
        )
        if self.device.type == "cuda":
            return unv
        delta = dd.delta(torch.from_numpy(rows), torch.from_numpy(unv))  # [num_reqs]
        ib.num_computed_tokens[rows] -= delta.numpy()
        return np.zeros(num, dtype=np.int64)

    def _device_draft_inputs(
        self,
        so: SchedulerOutput,
        inputs: StepInputs,
        rows: np.ndarray,
        n_sched: np.ndarray,
        unverified: np.ndarray,
    ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """``DeviceDrafts.prepare`` for the step; returns the drafts and valid mask it
        verifies ([num_reqs, k]) and the drafts each row verifies ([num_reqs], 0 without)."""
        dd = self.device_drafts
        assert dd is not None
        spec = so.scheduled_spec_tokens
        ks = np.zeros(len(rows), dtype=np.int64)
        if spec:  # (no pass over the batch while nothing drafts)
            ks = np.fromiter(
                (len(spec.get(r, ())) for r in so.num_scheduled_tokens), np.int64, len(rows)
            )
        used, valid = dd.prepare(
            inputs.input_ids, inputs.positions, inputs.metadata, n_sched, rows, unverified, ks
        )
        return used, valid, ks

    def _verify_device_drafts(
        self, step: LaunchedStep, samples: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``DeviceDrafts.verify`` for a step's samples ([P]); returns each sampling row's
        newest token [S] and what to copy to the host: the drafts each row's new lookup found
        [S], then the verified drafts and mask (not when no row had drafts)."""
        dd = self.device_drafts
        assert dd is not None
        seq_t, seq_np, used, valid, ks, paused = step.device_drafts
        plan = step.plan
        idx = plan.sample_idx
        first = plan.first if plan.first is not None else np.arange(len(idx))
        width = int(seq_np[idx].max()) + 1
        bonus, found = dd.verify(
            samples, step.sample_rows, first, ks[idx], idx, seq_t, used, valid, width, not paused
        )
        return bonus, [found] + ([used, valid] if ks.any() else [])

"""``pagedllm bench throughput``: offline throughput on random token-id prompts.

Prompts and output lengths are drawn like vLLM's random dataset (uniform in
[len x (1 - range_ratio), len x (1 + range_ratio)]); every request ignores EOS so the output
length is fixed. Reports requests/s, output and total tokens/s, peak memory, the scheduler +
input-preparation cost per decode step, and the roofline fraction; writes JSON (and a PNG when
matplotlib is available) under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import platform
import pstats
import time
import traceback
import warnings
from typing import Any

import numpy as np
import torch

from pagedllm.bench._flags import add_device, add_dtype, add_load_format
from pagedllm.bench.kernel_table import KernelCosts, kernel_costs, kernel_kind, kernel_table
from pagedllm.bench.roofline import (
    StepRecord,
    measure_copy_bandwidth,
    measure_matmul_flops,
    model_cost,
    roofline,
)
from pagedllm.config import KV_CACHE_DTYPES
from pagedllm.worker.profiler import DeviceTimer


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags (the engine's ones keep the engine's names)."""
    p.add_argument(
        "--model",
        default="qwen3-0.6b",
        help="HF model folder or .gguf file; with --load-format dummy also a built-in shape "
        "name (qwen3-0.6b, llama-3.1-8b, gemma-3-270m).",
    )
    add_load_format(p)
    add_dtype(p)
    add_device(p)
    p.add_argument("--num-prompts", type=int, default=256, metavar="N", help="Requests.")
    p.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        metavar="N",
        help="Leading tokens every prompt shares (a system prompt), counted in its length.",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Automatic prefix caching (default on, as in the engine).",
    )
    p.add_argument(
        "--input-len", type=int, default=512, metavar="N", help="Mean prompt tokens (random ids)."
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=128,
        metavar="N",
        help="Mean output tokens; each request ignores EOS, so it generates exactly its length.",
    )
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        metavar="X",
        help="Lengths are uniform in [len x (1 - X), len x (1 + X)] (0: all the same).",
    )
    p.add_argument(
        "--max-model-len", type=int, default=4096, metavar="N", help="Context length of the engine."
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=256, metavar="N", help="Most requests in one batch."
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        metavar="N",
        help="Token budget of one engine step (default: the engine's, 2048 on a CPU, 8192 on a "
        "GPU).",
    )
    p.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Split long prompts across steps within the token budget (default on, as in the "
        "engine); off, a prompt is prefilled in one step and the budget grows to "
        "--max-model-len.",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        metavar="X",
        help="Fraction of the GPU's memory for weights, activations and KV cache (GPU only).",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Schedule the next step while the device runs this one (default: on with a GPU, "
        "off on a CPU).",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="Never capture CUDA graphs (GPU only; a CPU always runs eagerly).",
    )
    p.add_argument(
        "--seed", type=int, default=0, metavar="N", help="Seed of the workload and the engine."
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="Tensor-parallel ranks (one worker process each). With the model in worker "
        "processes the result has no device times and no roofline (they read the in-process "
        "model runner); benchmarks/scale_out_gpu.py gives the per-GPU roofline.",
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="Engine core processes (each its own KV cache and --tensor-parallel-size ranks), "
        "requests routed by load and prefix; the result then has no per-step figures.",
    )
    p.add_argument(
        "--distributed-executor-backend",
        default=None,
        choices=["uni", "mp", "ray"],
        help="How the engine reaches the model (default: uni, or mp with "
        "--tensor-parallel-size > 1).",
    )
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="KV-cache size in bytes, on any device (default: the engine's: on a GPU what "
        "--gpu-memory-utilization leaves, on a CPU 2 GiB).",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV-cache storage: auto (the model's dtype) or fp8 (float8 e4m3, scales 1.0).",
    )
    # KV-Compress (the paper's throughput experiment)
    p.add_argument(
        "--enable-kvc",
        action="store_true",
        help="KV-Compress: evict the least-attended KVs of each request down to a budget.",
    )
    p.add_argument(
        "--kvc-method",
        default="kvcompress",
        choices=["kvcompress", "uniform", "random"],
        help="KV-Compress eviction: kvcompress, or the uniform and random baselines.",
    )
    p.add_argument(
        "--compression-rate",
        type=float,
        default=None,
        metavar="X",
        help="KV-Compress: each request keeps 1/X of its KVs (default: unset; with "
        "--max-cache-tokens unset too, nothing is evicted).",
    )
    p.add_argument(
        "--max-cache-tokens",
        type=int,
        default=None,
        metavar="N",
        help="KV-Compress: each request keeps N KVs per layer and KV head (default: unset; "
        "wins over --compression-rate).",
    )
    p.add_argument(
        "--protected-window-size",
        type=int,
        default=32,
        metavar="N",
        help="KV-Compress: the last tokens never evicted.",
    )
    p.add_argument(
        "--compression-interval",
        type=int,
        default=None,
        metavar="N",
        help="KV-Compress: decode steps between evictions (default: only after the prompt and "
        "under memory pressure, as the paper's benchmark).",
    )
    p.add_argument(
        "--profile-host",
        default=None,
        metavar="PATH",
        help="Write a cProfile of the host side of the timed run to PATH (text; the raw stats "
        "to PATH.prof; default: no profile).",
    )
    p.add_argument(
        "--kernel-profile",
        default=None,
        metavar="START:COUNT",
        help="Device time by kernel over COUNT steps from step START of the timed run "
        "(torch.profiler; the JSON's kernel_profile; the run's times then include the "
        "profiler's cost). Default: none.",
    )
    p.add_argument(
        "--kv-map-report",
        default=None,
        metavar="PATH",
        help="Also write the dashboard's view of the run (block map, per-head KV-Compress heat "
        "map, requests; a frame every --kv-map-every s) as one self-contained HTML file "
        "(default: none).",
    )
    p.add_argument(
        "--kv-map-every",
        type=float,
        default=0.5,
        metavar="S",
        help="Seconds between the report's frames (each costs a snapshot, in the timings).",
    )
    p.add_argument(
        "--output-json",
        default=None,
        metavar="PATH",
        help="Result file (default: benchmarks/results/STEM.json, STEM from --name).",
    )
    p.add_argument(
        "--name",
        default=None,
        metavar="STEM",
        help="Result file stem (default: throughput_MODEL_DEVICE).",
    )


def make_workload(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab: int,
    seed: int,
    prefix_len: int = 0,
) -> tuple[list[list[int]], list[int]]:
    """Random prompts (ids in [100, vocab - 100)) and per-request output lengths; the first
    ``prefix_len`` ids of every prompt are the same (each prompt keeps at least one own id)."""
    rng = np.random.default_rng(seed)

    def lens(center: int) -> np.ndarray:
        lo = max(1, int(center * (1 - range_ratio)))
        hi = max(lo, int(center * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, size=num)

    in_lens, out_lens = lens(input_len), lens(output_len)
    prompts = [rng.integers(100, vocab - 100, size=int(n)).tolist() for n in in_lens]
    if prefix_len:
        shared = rng.integers(100, vocab - 100, size=prefix_len).tolist()
        prompts = [shared + p[prefix_len:] if len(p) > prefix_len else shared + p for p in prompts]
    return prompts, [int(n) for n in out_lens]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


class StepRecorder:
    """Wraps the scheduler and input preparation of an engine to record each step's shape and
    the host time they take (the engine's own overhead). With the model in worker processes
    (no in-process runner) only the scheduler is wrapped: shapes, no host times."""

    def __init__(self, llm: Any, profile_window: tuple[int, int] | None = None) -> None:
        core = llm.llm_engine.engine_core
        self.steps: list[StepRecord] = []
        self.host_s: list[float] = []
        self.decode_host_s: list[float] = []
        # KV-Compress: every 64th decode-only step, the running requests' KVs per head
        # ([rows, layers, KV heads]; see ``head_len_stats``). From the device's lengths when
        # the runner is in-process: under async scheduling the scheduler's are the lengths
        # before the evictions still in flight (a prompt just evicted shows all its tokens),
        # the kernel reads the device's. Copied without a sync, read after the run.
        self.head_lens: list[np.ndarray] = []
        self._device_lens: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        # ``kernel_profile``: torch.profiler over the steps [start, start + count)
        self.profile_window = profile_window
        self.profiler: Any = None
        self._profiling = False
        self._profile_t0 = 0.0  # perf_counter at the window's start
        self._profile_wall_s = 0.0  # the window's length on the host
        self._cuda = False
        self.profiled_steps: list[StepRecord] = []
        sched = getattr(core, "scheduler", None)
        self._t = 0.0
        if sched is None:  # data parallelism: the schedulers are in the core processes
            return
        orig_schedule = sched.schedule
        kvm = sched.kv_cache_manager
        states = getattr(kvm, "states", None) if hasattr(kvm, "head_extent") else None

        def schedule():  # noqa: ANN202
            t = time.perf_counter()
            so = orig_schedule()
            self._t = time.perf_counter() - t
            if so.total_num_scheduled_tokens:
                n = list(so.num_scheduled_tokens.values())
                seq = [sched.requests[r].num_computed_tokens for r in so.num_scheduled_tokens]
                self.steps.append(StepRecord(n, seq))
                self._profile(len(self.steps) - 1)
                if self._profiling:
                    self.profiled_steps.append(self.steps[-1])
                if device_lens and len(self.steps) % 64 == 0 and max(n) == 1:
                    self._sample_next = True
                elif states is not None and len(self.steps) % 64 == 0 and max(n) == 1:
                    lens = [states[r].lens for r in so.num_scheduled_tokens if r in states]
                    if lens:
                        h = kvm.spec.num_kv_heads
                        self.head_lens.append(np.stack(lens).reshape(len(lens), -1, h))
            return so

        runner = getattr(getattr(core, "executor", None), "runner", None)
        layout = getattr(runner, "kv_layout", None)
        kvc = layout if getattr(layout, "name", None) == "kvcompress" else None
        device_lens = kvc is not None
        cuda = runner is not None and runner.device.type == "cuda"
        self._cuda = cuda
        self._sample_next = False
        sched.schedule = schedule
        if runner is None:  # the model is in worker processes: scheduling is all we see
            return
        prep = runner.inputs
        orig_prepare = prep.prepare

        def prepare(rows, n_sched, *extra):  # noqa: ANN001, ANN002, ANN202
            t = time.perf_counter()
            out = orig_prepare(rows, n_sched, *extra)
            host = self._t + time.perf_counter() - t
            self.host_s.append(host)
            if int(n_sched.max()) == 1:
                self.decode_host_s.append(host)
            if self._sample_next:  # after the step's slots: the lengths its kernels read
                self._sample_next = False
                # (pinned, non-blocking: a pageable copy to the device would sync the host,
                # and the bench counts the syncs: its own probe must not add any)
                idx = torch.from_numpy(np.asarray(rows, dtype=np.int64))
                idx = idx.pin_memory() if cuda else idx
                idx = idx.to(runner.device, non_blocking=cuda)
                lens = torch.empty((len(rows), kvc.num_heads), dtype=kvc.lens.dtype,
                                   pin_memory=cuda)  # fmt: skip
                lens.copy_(kvc.lens[idx], non_blocking=cuda)
                ev = torch.cuda.Event() if cuda else None
                if ev is not None:
                    ev.record()
                self._device_lens.append((lens, ev))
            return out

        prep.prepare = prepare
        self._kv_heads = kvc.spec.num_kv_heads if kvc is not None else 1

    def _profile(self, step: int) -> None:
        """Start or stop the kernel profiler at the window's edges (``profile_window``)."""
        if self.profile_window is None:
            return
        start, count = self.profile_window
        if step == start:
            from torch.profiler import ProfilerActivity, profile

            kind = ProfilerActivity.CUDA if self._cuda else ProfilerActivity.CPU
            self.profiler = profile(activities=[kind])
            self.profiler.start()
            self._profiling = True
            self._profile_t0 = time.perf_counter()
        elif step == start + count and self._profiling:
            self._stop_profiler()

    def _stop_profiler(self) -> None:
        self.profiler.stop()  # (the profiler stays: ``kernel_profile`` reads it)
        self._profiling = False
        self._profile_wall_s = time.perf_counter() - self._profile_t0

    def finish(self) -> None:
        """After the run: the device lengths' copies are read (each waited for on its event);
        a profiler still open (the run had fewer steps than the window) is stopped."""
        for lens, ev in self._device_lens:
            if ev is not None:
                ev.synchronize()
            x = lens.numpy()
            self.head_lens.append(x.reshape(len(x), -1, self._kv_heads))
        self._device_lens = []
        if self._profiling:
            self._stop_profiler()

    def kernel_profile(
        self, costs: KernelCosts | None = None, bandwidth: float = 0.0, peak_flops: float = 0.0
    ) -> dict | None:
        """Device time by kernel over the profiled steps (on a CPU: self time by operator):
        per step, the top 25, with how many of those steps were decode-only and their mean
        running requests. On a GPU with ``costs``, also the per-kernel table (``by_kind``:
        each kind's time against its bytes and FLOPs at ``bandwidth`` and ``peak_flops``,
        ``bench/kernel_table.py``)."""
        if self.profiler is None or not self.profiled_steps:
            return None
        n = len(self.profiled_steps)
        top = []
        kinds: dict[str, float] = {}
        for e in self.profiler.key_averages():
            ms = (e.self_device_time_total if self._cuda else e.self_cpu_time_total) / 1e3
            if ms > 0:
                top.append((ms, e.count, e.key[:100]))
                kind = kernel_kind(e.key)
                kinds[kind] = kinds.get(kind, 0.0) + ms
        top.sort(reverse=True)
        decode = [s for s in self.profiled_steps if max(s.num_tokens) == 1]
        out = {
            "steps": n,
            "first_step": self.profile_window[0] if self.profile_window else None,
            "decode_only_steps": len(decode),
            "running_mean": float(np.mean([len(s.num_tokens) for s in self.profiled_steps])),
            "device_ms_per_step": sum(ms for ms, _, _ in top) / n,
            # the host's time for the window (the profiler's own cost included)
            "wall_ms_per_step": self._profile_wall_s * 1e3 / n,
            "top_ms_per_step": [
                {"ms": ms / n, "calls_per_step": c / n, "name": k} for ms, c, k in top[:25]
            ],
        }
        if self._cuda:  # where the device waited: every kernel and copy of the window
            device = torch.autograd.DeviceType.CUDA
            spans = [(e.time_range.start, e.time_range.end)
                     for e in self.profiler.events() if e.device_type == device]  # fmt: skip
            out.update(device_gaps(spans, n))
            if costs is not None:
                out["copy_bandwidth_GBps"] = bandwidth / 1e9
                out["matmul_TFLOPs"] = peak_flops / 1e12
                out["by_kind"] = kernel_table(kinds, self.profiled_steps, costs, bandwidth,
                                              peak_flops)  # fmt: skip
        return out


def device_gaps(spans: list[tuple[float, float]], steps: int) -> dict:
    """Idle time between the device's work (``spans``: (start, end) in us, any order, may
    overlap) over ``steps`` steps: the busy fraction of the span from the first start to the
    last end, the idle ms a step, and the largest gaps (ms).

    Example: (0, 4), (2, 6), (8, 10), (30, 31) over 2 steps -> busy 9 of 31 us (0.29), idle
    0.011 ms a step, gaps 0.020 and 0.002 ms."""
    if not spans:
        return {"device_busy_in_window": None}
    spans = sorted(spans)
    gaps = []
    end = spans[0][1]
    for a, b in spans[1:]:
        if a > end:
            gaps.append(a - end)
        end = max(end, b)
    span = end - spans[0][0]
    idle = float(sum(gaps))
    return {
        "device_busy_in_window": (span - idle) / span if span > 0 else None,
        "device_idle_ms_per_step": idle / 1e3 / steps,
        "device_largest_gaps_ms": [g / 1e3 for g in sorted(gaps, reverse=True)[:5]],
    }


def run(args: argparse.Namespace) -> dict:
    from pagedllm import LLM, SamplingParams

    kwargs = dict(
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.async_scheduling is not None:
        kwargs["async_scheduling"] = args.async_scheduling
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.kv_cache_memory_bytes:
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    kvc_params: dict[str, Any] = {}
    if args.enable_kvc:
        kwargs.update(
            enable_kvc=True,
            kvc_method=args.kvc_method,
            protected_window_size=args.protected_window_size,
            compress_once=args.compression_interval is None,
            compression_interval=args.compression_interval or 1,
        )
        if args.max_cache_tokens is not None:
            kvc_params["max_cache_tokens"] = args.max_cache_tokens
        elif args.compression_rate is not None:
            kvc_params["compression_rate"] = args.compression_rate
    t0 = time.perf_counter()
    llm = LLM(args.model, **kwargs)
    startup = time.perf_counter() - t0
    mc = llm.llm_engine.config.model_config
    # the in-process runner (its device times, model and KV-Compress state), or None when the
    # model runs in worker processes (tensor parallelism): those fields are then left empty
    core = llm.llm_engine.engine_core
    runner = getattr(getattr(core, "executor", None), "runner", None)
    device = (
        runner.device
        if runner is not None
        else torch.device(llm.llm_engine.config.device_config.device)
    )
    prompts, out_lens = make_workload(
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.range_ratio,
        mc.vocab_size,
        args.seed,
        args.prefix_len,
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kvc_params)
        for n in out_lens
    ]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    # warm-up on reversed prompts: nothing of the workload is in the prefix cache before it.
    # With the workload's KV-Compress budget, so that the eviction runs once here. Triton
    # compiles a kernel variant when a step first meets it (seconds, the step stalled):
    # ``triton_compiles_timed`` below says whether any was left for the timed run (the
    # engine compiles KV-Compress's decode variants at start-up, warm_up_decode_kernels).
    llm.generate(
        [{"prompt_token_ids": p[::-1]} for p in prompts[:4]],
        [SamplingParams(max_tokens=4, ignore_eos=True, **kvc_params)] * len(inputs[:4]),
        use_tqdm=False,
    )
    # and one short prompt alone: the prefill kernels take other tiles below LONG_CHUNK
    # tokens (paged_attention.default_tile_config), a variant long prompts never meet, whose
    # compile would otherwise land inside the timed run
    llm.generate(
        [{"prompt_token_ids": prompts[-1][::-1][:512]}],
        [SamplingParams(max_tokens=4, ignore_eos=True, **kvc_params)],
        use_tqdm=False,
    )
    window = None
    if getattr(args, "kernel_profile", None):
        start, _, count = args.kernel_profile.partition(":")
        window = (int(start), int(count or 50))
    rec = StepRecorder(llm, window)
    frames = None
    if getattr(args, "kv_map_report", None):
        if getattr(core, "scheduler", None) is None:
            raise ValueError("kv_map_report needs the engine core in this process (no data "
                             "parallelism).")  # fmt: skip
        from pagedllm.dashboard.report import FrameRecorder

        frames = FrameRecorder(core, args.kv_map_every)
    # counters from the scheduler, or (data parallelism) the core processes' merged stats
    kv = getattr(getattr(core, "scheduler", None), "kv_cache_manager", None)
    kvc_before = tuple(
        getattr(kv, a, 0) for a in ("num_compressions", "num_evicted_kvs", "num_prefix_copies")
    )
    before = _counters(core)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    timer = None
    if device.type == "cuda" and runner is not None:  # CUDA events around each step
        timer = runner.profiler = DeviceTimer()
        runner.kv_layout.profiler = timer  # (KV-Compress times its evictions: a span)
    prof = cProfile.Profile() if getattr(args, "profile_host", None) else None
    with count_host_syncs(device) as syncs, time_triton_compiles() as compiles:
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        outs = llm.generate(inputs, params, use_tqdm=False)
        if prof is not None:
            prof.disable()
        elapsed = time.perf_counter() - t
    rec.finish()
    if frames is not None:
        from pagedllm.dashboard.report import write_report

        path = write_report(args.kv_map_report, frames.finish(), mc.served_model_name)
        print(f"wrote {path} ({len(frames.frames)} frames)")
    if prof is not None:
        with open(args.profile_host, "w") as f:
            for key in ("tottime", "cumulative"):
                pstats.Stats(prof, stream=f).sort_stats(key).print_stats(45)
        prof.dump_stats(args.profile_host + ".prof")  # (callers and callees: pstats)
    device_times: list[float] = []
    compress_s: list[float] = []
    evict_steps: list[int] = []
    if timer is not None:
        runner.profiler = runner.kv_layout.profiler = None
        device_times = timer.step_seconds
        compress_s, evict_steps = timer.span_seconds("kvc_evict"), timer.span_steps("kvc_evict")
    after = _counters(core)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    assert n_out == sum(out_lens), "every request must produce exactly its output length"
    bw = measure_copy_bandwidth(device)
    flops = measure_matmul_flops(device, mc.torch_dtype)
    cost = model_cost(runner.model, mc.torch_dtype, runner.kv_dtype) if runner is not None else None
    roof = roofline(rec.steps, cost, bw, flops) if cost is not None else None
    result = {
        "engine": "pagedllm",
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "model": args.model,
        "dtype": mc.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "num_params": cost.num_params if cost is not None else None,
        "tensor_parallel_size": args.tensor_parallel_size,
        "cuda_graphs": device.type == "cuda" and not args.enforce_eager,
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "range_ratio": args.range_ratio,
            "total_input_tokens": n_in,
            "total_output_tokens": n_out,
            "prefix_len": args.prefix_len,
        },
        "enable_prefix_caching": args.enable_prefix_caching,
        "enable_chunked_prefill": args.enable_chunked_prefill,
        # prompt tokens the prefix cache gave (not computed) over those looked up
        "prefix_cache_hit_rate": (after["prefix_cache_hits"] - before["prefix_cache_hits"])
        / max(after["prefix_cache_queries"] - before["prefix_cache_queries"], 1),
        "startup_s": startup,
        "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed,
        "peak_memory_gib": (
            torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        ),
        "kv_cache_blocks": runner.num_blocks if runner is not None else after["num_blocks"],
        "data_parallel_size": args.data_parallel_size,
        "steps": len(rec.steps) if rec.steps else None,
        "host_ms_per_step_mean": 1e3 * float(np.mean(rec.host_s)) if rec.host_s else None,
        "host_ms_per_decode_step_mean": (
            1e3 * float(np.mean(rec.decode_host_s)) if rec.decode_host_s else None
        ),
        "max_running_in_decode_step": max(
            (len(s.num_tokens) for s in rec.steps if max(s.num_tokens) == 1), default=0
        ),
        "concurrent_seqs_mean": (
            float(np.mean([len(s.num_tokens) for s in rec.steps])) if rec.steps else 0.0
        ),
        "concurrent_seqs_peak": max((len(s.num_tokens) for s in rec.steps), default=0),
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        # steps scheduled before the last step's results came back, and of those the ones
        # that took them first for KV-Compress evictions (``Scheduler.wants_results_first``)
        "async_steps": _delta(after, before, "num_async_steps"),
        "eviction_waits": _delta(after, before, "num_results_first"),
        # implicit host syncs (a blocking copy, .item(), a boolean mask...) PyTorch reported
        # while the workload ran; the one wait per step for the sampled tokens is not one
        # device time of a step: a CUDA event before its forward pass to one after sampling
        "device_ms_per_step_mean": (1e3 * float(np.mean(device_times)) if device_times else None),
        "device_busy_fraction": float(np.sum(device_times)) / elapsed if device_times else None,
        **_phase_split(rec.steps, device_times),
        **_compress_split(rec.steps, device_times, compress_s, evict_steps),
        **head_len_stats(rec.head_lens),
        "host_syncs": syncs.count,
        "host_sync_sources": dict(syncs.sources.most_common(12)),
        # Triton kernels compiled inside the timed run (each a host stall; 0 once warmed up)
        "triton_compiles_timed": compiles.count,
        "triton_compile_s_timed": compiles.seconds,
        "triton_compiled_kernels_timed": dict(compiles.kernels.most_common(20)),
        "triton_compile_keys_timed": compiles.keys,
        "host_syncs_per_step": (
            syncs.count / max(len(rec.steps), 1) if syncs.count is not None else None
        ),
        "kvc": (
            {
                "method": args.kvc_method,
                "params": kvc_params,
                "protected_window_size": args.protected_window_size,
                "compression_interval": args.compression_interval,
                "compressions": kv.num_compressions - kvc_before[0],
                "evicted_kvs": kv.num_evicted_kvs - kvc_before[1],
                "eviction_steps": len(compress_s),
                "compress_ms_total": 1e3 * sum(compress_s),
                "compress_ms_per_step": 1e3 * sum(compress_s) / max(len(rec.steps), 1),
                "compress_ms_per_eviction_step": (
                    1e3 * sum(compress_s) / len(compress_s) if compress_s else None
                ),
                # blocks copied so that cached prompt blocks outlive their eviction
                "prefix_copy_blocks": getattr(kv, "num_prefix_copies", 0) - kvc_before[2],
                "metadata_bytes_per_kv": runner.kv_layout.metadata_bytes_per_kv(),
                "kv_bytes": runner.kv_layout.spec.page_bytes // runner.kv_layout.block_size,
            }
            if args.enable_kvc and kv is not None and runner is not None
            else None
        ),
        "copy_bandwidth_GBps": bw / 1e9,
        "matmul_TFLOPs": flops / 1e12,
        "roofline": None
        if roof is None
        else {
            "ideal_s": roof.ideal_s,
            "memory_s": roof.memory_s,
            "compute_s": roof.compute_s,
            "achieved_fraction": roof.ideal_s / elapsed,
            "decode_steps": roof.decode_steps,
            "steps": roof.steps,
        },
        "first_tokens": [o.outputs[0].token_ids[:8] for o in outs[:4]],
    }
    if window is not None:  # the profiler's own cost is inside this run's times
        # the per-kernel table models plain caches (KV-Compress's kernels read the evicted
        # lengths, which the step records do not hold)
        kc = None
        if cost is not None and not args.enable_kvc:
            kc = kernel_costs(runner.model, cost, mc.torch_dtype.itemsize)
        result["kernel_profile"] = rec.kernel_profile(kc, bw, flops)
    return result


def _delta(after: dict, before: dict, key: str) -> int | None:
    """A counter's growth over the run; None where the engine did not report it."""
    return after[key] - before[key] if key in after else None


def _counters(core: Any) -> dict[str, int]:
    """Prefix-cache lookups and hits, preemptions and KV blocks: the in-process scheduler's,
    or the merged stats of the engine core processes (data parallelism)."""
    sched = getattr(core, "scheduler", None)
    if sched is None:
        stats = core.stats()
        keys = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_blocks")
        return {k: int(stats.get(k, 0)) for k in keys}
    kv = sched.kv_cache_manager
    pool = getattr(kv, "block_pool", None)
    return {
        "prefix_cache_queries": kv.prefix_cache_queries,
        "prefix_cache_hits": kv.prefix_cache_hits,
        "num_preemptions": sched.num_preemptions,
        "num_blocks": getattr(pool, "num_blocks", None) or getattr(kv, "num_blocks", 0),
        "num_async_steps": core.num_async_steps,
        "num_results_first": core.num_results_first,
    }


def _phase_split(steps: list, device_times: list[float]) -> dict:
    """Device time of the decode-only steps (mean) and of the steps with prompt tokens (total),
    when every step was timed."""
    if not device_times or len(device_times) != len(steps):
        return {}
    dt = np.asarray(device_times)
    decode = np.array([max(s.num_tokens) == 1 for s in steps])
    return {
        "device_ms_per_decode_step": 1e3 * float(dt[decode].mean()) if decode.any() else None,
        "device_s_decode_steps": float(dt[decode].sum()),
        "device_s_prefill_steps": float(dt[~decode].sum()),
        "prefill_steps": int((~decode).sum()),
    }


def head_len_stats(samples: list[np.ndarray]) -> dict:
    """KV-Compress: how uneven the heads' lengths are in the sampled decode steps (each
    [rows, layers, KV heads]). ``layer_max_over_mean``: per layer, the longest head over the
    mean head (one program per (row, KV head) runs a layer's decode: the longest sets a floor
    under its time), averaged over layers and samples; quantiles of every head's length.
    Example: a layer with heads [100, 100, 100, 900] -> 900 / 300 = 3.0."""
    if not samples:
        return {}
    ratios = [float(np.mean(x.max(axis=(0, 2)) / np.maximum(x.mean(axis=(0, 2)), 1e-9)))
              for x in samples]  # fmt: skip
    flat = np.concatenate([x.reshape(-1) for x in samples])
    q = np.percentile(flat, [50, 90, 99]).tolist()
    return {
        "head_len_samples": len(samples),
        "head_len_mean": float(flat.mean()),
        "head_len_p50_p90_p99": q,
        "head_len_max": int(flat.max()),
        "layer_max_over_mean": float(np.mean(ratios)),
    }


def _compress_split(steps: list, device_times: list[float], compress_s: list[float],
                    at: list[int]) -> dict:  # fmt: skip
    """KV-Compress: eviction device time in decode-only steps and in steps with prompt
    tokens, and the decode-only steps' device time without it (when every step was timed;
    ``at``: the timed step of each eviction)."""
    if not compress_s or not at or len(at) != len(compress_s):
        return {}
    if not device_times or len(device_times) != len(steps):
        return {}
    decode = np.array([max(s.num_tokens) == 1 for s in steps])
    c = np.zeros(len(steps))
    np.add.at(c, np.asarray(at), np.asarray(compress_s))
    dt = np.asarray(device_times) - c
    return {
        "compress_s_decode_steps": float(c[decode].sum()),
        "compress_s_prefill_steps": float(c[~decode].sum()),
        "decode_steps_with_evictions": int((decode & (c > 0)).sum()),
        "device_ms_per_decode_step_without_evictions": (
            1e3 * float(dt[decode].mean()) if decode.any() else None
        ),
    }


class count_host_syncs:  # noqa: N801 (a context manager used like a function)
    """Counts the implicit host syncs PyTorch reports on a GPU (``set_sync_debug_mode``:
    blocking copies, ``.item()``, boolean-mask indexing, ...) inside the block, and where they
    come from (the innermost pagedllm frames); ``count`` is None elsewhere. Explicit waits
    (``Event.synchronize``) are not counted."""

    def __init__(self, device: torch.device) -> None:
        self.on = device.type == "cuda"
        self.count: int | None = None
        self.sources: collections.Counter[str] = collections.Counter()

    def _hook(self, message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        if "synchronizing" not in str(message):
            return
        self.count = (self.count or 0) + 1
        frames = [f for f in traceback.extract_stack()[:-1] if "pagedllm" in f.filename]
        where = " <- ".join(
            f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames[-3:])
        )
        self.sources[where or f"{filename}:{lineno}"] += 1

    def __enter__(self) -> count_host_syncs:
        if self.on:
            self.count = 0
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = self._hook
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.on:
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(*exc)


class time_triton_compiles:  # noqa: N801 (a context manager used like a function)
    """Counts the Triton kernels compiled (or loaded from Triton's disk cache) inside the block
    and the seconds spent doing it: a kernel variant first met in a timed run stalls the host
    for a compile. Wraps ``JITFunction._do_compile`` (Triton 3.3 on); ``count`` is None where
    Triton or that method is missing."""

    def __init__(self) -> None:
        self.count: int | None = None
        self.seconds = 0.0
        self.kernels: collections.Counter[str] = collections.Counter()  # name -> compiles
        self.keys: list[str] = []  # the first compiles' cache keys
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            JITFunction = None  # noqa: N806
        self._cls = JITFunction if hasattr(JITFunction, "_do_compile") else None

    def __enter__(self) -> time_triton_compiles:
        if self._cls is None:
            return self
        self.count = 0
        original = self._original = self._cls._do_compile

        def timed(fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            t = time.perf_counter()
            try:
                return original(fn, *args, **kwargs)
            finally:
                self.count += 1
                self.seconds += time.perf_counter() - t
                self.kernels[getattr(fn, "__name__", None) or repr(fn)[:60]] += 1
                if len(self.keys) < 8:  # what it specialized on (the reason it compiled)
                    self.keys.append(str(args[0])[:4000] if args else "")

        self._cls._do_compile = timed
        return self

    def __exit__(self, *exc: object) -> None:
        if self._cls is not None:
            self._cls._do_compile = self._original


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def write_result(result: dict, name: str, out_dir: str = "benchmarks/results") -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return path


def main(args: argparse.Namespace) -> None:
    result = run(args)
    name = args.name or f"throughput_{args.model.replace('/', '_')}_{result['device']}".replace(
        " ", "_"
    )
    path = args.output_json or write_result(result, name)
    if args.output_json:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    keys = (
        "device",
        "requests_per_s",
        "output_tokens_per_s",
        "total_tokens_per_s",
        "host_ms_per_decode_step_mean",
    )
    print(json.dumps({k: result[k] for k in keys} | {"roofline": result["roofline"]}, indent=2))
    print(f"wrote {path}")

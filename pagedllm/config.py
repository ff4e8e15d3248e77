"""Engine configuration: frozen dataclasses validated in ``__post_init__``.

``EngineArgs`` holds what a user passes (the names are vLLM's); ``create_engine_config()`` checks
each value, resolves 'auto' choices and the model's own config, and returns an ``EngineConfig``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from pagedllm.core.kv_transfer.config import KVTransferConfig
from pagedllm.lora.config import LoRAConfig, LoRAModulePath, lora_config_from
from pagedllm.sampling_params import check_compression_rate
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.structured_output.params import MAX_JSON_WHITESPACE, MAX_JSON_WHITESPACE_SETTING
from pagedllm.utils.cpus import check_bind

if TYPE_CHECKING:
    import argparse

# the values the engine accepts (its CLI flags and the benchmarks' offer them as choices)
DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
# the KV cache's storage: auto = the model's dtype; fp8 (= fp8_e4m3): e4m3 with a scale per
# layer, KV head and K/V (pagedllm/kv_layout.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def _kv_cache_dtype(name: str) -> str:
    """``kv_cache_dtype`` resolved: "auto", or "fp8" for either fp8 name; ValueError else."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}.")
    return "auto" if name == "auto" else "fp8"


DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# how the engine core reaches the model: in its own process, or one worker process per rank
EXECUTOR_BACKENDS = ("uni", "mp", "ray")


def _positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


@dataclass(frozen=True)
class ModelConfig:
    """The model: where it lives, its HF config, dtype and context length."""

    model: str
    tokenizer: str
    load_format: str  # safetensors | gguf | dummy
    dtype: str  # float32 | bfloat16 | float16
    max_model_len: int
    seed: int
    hf_config: Any = field(compare=False, repr=False)
    served_model_name: str = ""

    def __post_init__(self) -> None:
        if self.load_format not in ("safetensors", "gguf", "dummy"):
            raise ValueError(
                f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}."
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}.")
        _positive_int("max_model_len", self.max_model_len)

    @property
    def torch_dtype(self):  # noqa: ANN201 - torch imported lazily
        import torch

        return getattr(torch, self.dtype)

    @property
    def text_config(self) -> Any:
        return getattr(self.hf_config, "text_config", None) or self.hf_config

    @property
    def num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        c = self.text_config
        return int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)

    @property
    def head_dim(self) -> int:
        c = self.text_config
        return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and how much memory (or how many blocks) it gets."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None  # CPU (or explicit GPU) size of the KV cache
    enable_prefix_caching: bool = True
    swap_space_bytes: int = 0  # host memory for swapped-out blocks
    kv_offloading_bytes: int = 0  # the host KV tier of the prefix cache (0: none)
    kv_transfer: KVTransferConfig | None = None  # prefill/decode disaggregation (None: off)
    preemption_mode: str = "recompute"  # recompute | swap | auto
    # sliding-window layers keep the whole context, as full attention does (vLLM's flag)
    disable_hybrid_kv_cache_manager: bool = False
    cache_dtype: str = "auto"  # auto | fp8 (any of KV_CACHE_DTYPES; fp8_e4m3 becomes fp8)
    # fp8: each layer's K/V scales per KV head from the first step with real tokens (else 1.0,
    # or the checkpoint's k_scale / v_scale)
    calculate_kv_scales: bool = False

    @property
    def fp8(self) -> bool:
        """Whether the KV cache is stored in float8 e4m3 (``kv_layout.kv_cache_dtype``)."""
        return self.cache_dtype == "fp8"

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_dtype", _kv_cache_dtype(self.cache_dtype))
        if self.calculate_kv_scales and not self.fp8:
            raise ValueError("calculate_kv_scales needs kv_cache_dtype 'fp8'.")
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1 or bs > 256 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two from 1 to 256, got {bs!r}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}."
            )
        _positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override, allow_none=True)
        _positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, allow_none=True)
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(
                "preemption_mode must be one of ('recompute', 'swap', 'auto'), got "
                f"{self.preemption_mode!r}."
            )
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space must be non-negative, got {self.swap_space_bytes!r}.")
        if self.kv_offloading_bytes < 0:
            raise ValueError(
                f"kv_offloading_size must be non-negative, got {self.kv_offloading_bytes!r}."
            )
        if self.preemption_mode == "swap" and not (
            self.swap_space_bytes or self.kv_offloading_bytes
        ):
            raise ValueError(
                "preemption_mode 'swap' needs swap_space > 0 (GiB of host memory) or "
                "kv_offloading_size (the host tier)."
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """The token budget of one step and how many requests may run at once."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    sjf_aging_rate: float = 100.0  # tokens of rank gained per second of waiting (sjf)
    # Schedule and launch step N+1 before step N's tokens reach the host, so the host work of
    # one step overlaps the device work of the next (see engine/core.py).
    async_scheduling: bool = False
    # Structured outputs: advance the grammars and fill their token bitmasks in a worker
    # process beside the engine loop, instead of in the loop (see structured_output/grammars.py)
    grammar_process: bool = False

    def __post_init__(self) -> None:
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_num_seqs", self.max_num_seqs)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}) while enable_chunked_prefill is False: "
                "long prompts could never be scheduled. Raise max_num_batched_tokens or enable "
                "chunked prefill."
            )
        if self.policy not in ("fcfs", "priority", "sjf"):
            raise ValueError(
                "scheduling_policy must be one of ('fcfs', 'priority', 'sjf'), got "
                f"{self.policy!r}."
            )
        if not self.sjf_aging_rate >= 0:
            raise ValueError(f"sjf_aging_rate must be non-negative, got {self.sjf_aging_rate!r}.")


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs."""

    device: str = "cpu"  # resolved: cpu | cuda
    enforce_eager: bool = False
    # the CPU path's torch threads (None: the bound CPUs' count, or torch's default) and
    # the CPUs each rank is bound to ("none" | "auto" | "0-3|4-7"; utils/cpus.py)
    cpu_threads: int | None = None
    cpu_threads_bind: str = "none"

    def __post_init__(self) -> None:
        _positive_int("cpu_threads", self.cpu_threads, allow_none=True)
        check_bind(self.cpu_threads_bind)
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}.")


ALL2ALL_BACKENDS = ("allgather_reducescatter", "alltoallv")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor and data parallel sizes (data parallelism: engine cores behind one server,
    ``engine/dp_async_llm.py``), and the executor: ``"uni"`` runs the model in the engine's
    process, ``"mp"`` in one worker process per tensor-parallel rank (torch.distributed
    between them: NCCL on GPUs, gloo on CPUs)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = "uni"
    # GPUs: NCCL for every all-reduce, not the symmetric-memory kernel
    # (``distributed/parallel_state.py``)
    disable_custom_all_reduce: bool = False
    # mixtures of experts: whole experts split over the tensor-parallel ranks, or over the
    # data-parallel engine cores when data_parallel_size > 1 (vLLM's flag)
    enable_expert_parallel: bool = False
    # one engine core's place among the data-parallel cores, and the local ports of their
    # groups: the experts' exchange and the step agreement (set by the front end)
    data_parallel_rank: int = 0
    data_parallel_master_port: int = 0
    data_parallel_rpc_port: int = 0
    # how those cores' MoE layers exchange tokens (distributed/expert_parallel.py)
    all2all_backend: str = "allgather_reducescatter"
    # dual-batch overlap (worker/ubatch.py): a step as two micro-batches, one's MoE exchange
    # behind the other's compute, when a core's batch has at least these tokens
    enable_dbo: bool = False
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512
    # decode context parallelism: each KV head's tokens split over this many of the
    # tensor-parallel ranks that would each hold a copy (``attention/dcp.py``)
    decode_context_parallel_size: int = 1

    @property
    def dp_expert_parallel(self) -> bool:
        """Whether the data-parallel cores share their experts (and step together)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    def __post_init__(self) -> None:
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _positive_int("data_parallel_size", self.data_parallel_size)
        _positive_int("decode_context_parallel_size", self.decode_context_parallel_size)
        if self.tensor_parallel_size % self.decode_context_parallel_size:
            raise ValueError(
                f"decode_context_parallel_size ({self.decode_context_parallel_size}) must "
                f"divide tensor_parallel_size ({self.tensor_parallel_size}): its ranks are "
                "tensor-parallel ranks."
            )
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                f"got {self.distributed_executor_backend!r}."
            )
        if self.tensor_parallel_size > 1 and self.distributed_executor_backend == "uni":
            raise ValueError(
                "distributed_executor_backend 'uni' runs one rank; tensor_parallel_size > 1 "
                "needs 'mp'."
            )
        if self.dp_expert_parallel and self.tensor_parallel_size > 1:
            raise ValueError(
                "enable_expert_parallel with data_parallel_size > 1 splits the experts over "
                "the data-parallel engine cores, each of tensor_parallel_size 1; "
                "tensor_parallel_size > 1 inside each core is not supported with it yet."
            )
        if self.all2all_backend not in ALL2ALL_BACKENDS:
            raise ValueError(
                f"all2all_backend must be one of {ALL2ALL_BACKENDS}, got {self.all2all_backend!r}."
            )
        _positive_int("dbo_decode_token_threshold", self.dbo_decode_token_threshold)
        _positive_int("dbo_prefill_token_threshold", self.dbo_prefill_token_threshold)
        if self.enable_dbo and not self.dp_expert_parallel:
            raise ValueError(
                "enable_dbo overlaps the MoE exchanges of expert parallelism over "
                "data-parallel engine cores: it needs enable_expert_parallel and "
                "data_parallel_size > 1."
            )


_KVC_METHODS = ("kvcompress", "uniform", "random")


@dataclass(frozen=True)
class KVCompressConfig:
    """KV-Compress (``--enable-kvc``): a block holds ``block_size`` tokens of ONE KV head of ONE
    layer, and each request's KVs are evicted by attention score down to a budget (see
    ``pagedllm/kvcompress/``). The per-request fields of ``SamplingParams``
    (``max_cache_tokens``, ``compression_rate``, ``protected_window_size``, ``compress_once``)
    default to the values here.

    ``method``: 'kvcompress' (cheapest blocks across every layer and head of the sequence),
    'uniform' (the same budget split evenly over layers and heads, SnapKV-style) or 'random'
    (random scores): the last two are quality baselines."""

    enabled: bool = False
    method: str = "kvcompress"
    max_cache_tokens: int | None = None
    compression_rate: float | None = None
    protected_window_size: int = 32
    compress_once: bool = False
    compression_interval: int = 1  # steps between compressions when compress_once is False
    num_sinks: int = 0  # the first tokens, never evicted
    prefill_metric_collection_window_size: int = 32  # last prompt queries that score keys
    maxpool_metrics: bool = True
    # 31, not the paper's 7: a needle's later tokens (a number's digits) get little attention
    # from the prompt's last queries and a narrow pool evicts them; the quality suite's A/B
    # (benchmarks/README.md, "KV-Compress quality") keeps the needles at 2-16x with 31
    maxpool_kernel: int = 31
    # 'kvcompress' only: each compressible head keeps at least this fraction of an even share
    # of the budget's evictable KVs (AdaKV's safeguard; 0: none, 1: uniform's split)
    head_floor: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in _KVC_METHODS:
            raise ValueError(f"kvc_method must be one of {_KVC_METHODS}, got {self.method!r}.")
        _positive_int("max_cache_tokens", self.max_cache_tokens, allow_none=True)
        check_compression_rate(self.compression_rate)
        if self.max_cache_tokens is not None and self.compression_rate is not None:
            raise ValueError("set max_cache_tokens or compression_rate, not both.")
        for name in ("protected_window_size", "num_sinks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}.")
        _positive_int("compression_interval", self.compression_interval)
        _positive_int(
            "prefill_metric_collection_window_size", self.prefill_metric_collection_window_size
        )
        k = self.maxpool_kernel
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or k % 2 == 0:
            raise ValueError(f"maxpool_kernel must be an odd positive integer, got {k!r}.")
        f = self.head_floor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise ValueError(f"kvc_head_floor must be a number in [0, 1], got {f!r}.")

    def budget_of(self, params: Any) -> tuple[int | None, float | None]:
        """(max_cache_tokens, compression_rate) a request is held to: its own, or the
        engine's defaults when it sets neither; (None, None): it is never evicted."""
        m, rate = params.max_cache_tokens, params.compression_rate
        if m is None and rate is None:
            return self.max_cache_tokens, self.compression_rate
        return m, rate


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Engine-wide defaults of structured outputs. ``max_whitespace``: the longest run of
    whitespace between the tokens of a JSON output (0: none, compact JSON), for every request
    that does not set ``disable_any_whitespace`` itself."""

    max_whitespace: int = MAX_JSON_WHITESPACE

    def __post_init__(self) -> None:
        n = self.max_whitespace
        if (
            isinstance(n, bool)
            or not isinstance(n, int)
            or not 0 <= n <= MAX_JSON_WHITESPACE_SETTING
        ):
            raise ValueError(
                "structured_outputs_max_whitespace must be an integer from 0 to "
                f"{MAX_JSON_WHITESPACE_SETTING}, got {n!r}."
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core, scheduler and model runner need, resolved and validated."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    parallel_config: ParallelConfig
    kvc_config: KVCompressConfig = KVCompressConfig()
    # KV connectors beyond KV-Compress, by registered name (core/sched/connector.py)
    kv_connectors: tuple[str, ...] = ()
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    # speculative decoding (pagedllm/spec_decode); None: off
    speculative_config: SpeculativeConfig | None = None
    # the draft model of speculative_config method "draft_model" (dtype and context length
    # the target's); None otherwise
    draft_model_config: ModelConfig | None = None
    # LoRA adapters (pagedllm/lora); None: off
    lora_config: LoRAConfig | None = None

    @property
    def kv_connector_names(self) -> tuple[str, ...]:
        """Every KV connector of the engine, in hook order (``kv_connector_names``)."""
        return kv_connector_names(self.kvc_config, self.kv_connectors)


def parse_names(text: str) -> tuple[str, ...]:
    """A comma-separated list of names: 'a, b' -> ('a', 'b')."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _with_offload(names: tuple[str, ...], offload: bool, transfer: bool = False) -> tuple[str, ...]:
    """The connectors named, plus the host tier's when ``kv_offloading_size`` is set and the
    KV transfer's when ``kv_transfer_config`` is (once each, the transfer's last: a request
    takes its prefix from the device, then the host tier, then the transfer)."""
    names = names + ("offload",) * (offload and "offload" not in names)
    return names + ("kv_transfer",) * (transfer and "kv_transfer" not in names)


def kv_connector_names(
    kvc_config: KVCompressConfig | None, extra: tuple[str, ...] = ()
) -> tuple[str, ...]:
    """The engine's KV connectors in hook order: the ``kv_connectors`` named, then KV-Compress
    when it is on. KV-Compress comes last because its eviction rewrites blocks the others read:
    a role that copies a step's KVs out (the host tier's saves, a transfer's rows) plans them
    before KV-Compress plans the eviction (which may take cached entries out of the device
    cache) and gathers them after the forward pass, before the eviction compacts the blocks.
    Example: enabled, ('offload',) -> ('offload', 'kvcompress')."""
    return tuple(extra) + ("kvcompress",) * bool(kvc_config is not None and kvc_config.enabled)


@dataclass
class EngineArgs:
    """Arguments of ``LLM(...)`` and ``pagedllm serve``, with vLLM's names and defaults."""

    model: str = ""
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    swap_space: float = 0.0  # GiB of host memory for swap preemption
    # GiB of host memory for prefix blocks the device cache gives up (vLLM's name; None: off)
    kv_offloading_size: float | None = None
    # prefill/decode disaggregation, vLLM's JSON: {"kv_role": "kv_producer" | "kv_consumer" |
    # "kv_both", ...} (core/kv_transfer/config.py); None: off
    kv_transfer_config: dict | str | KVTransferConfig | None = None
    preemption_mode: str = "recompute"
    disable_hybrid_kv_cache_manager: bool = False
    # the KV cache's dtype: auto (the model's) or fp8 / fp8_e4m3 (half the bytes a token)
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False  # fp8: scales from the first step's K/V (else 1.0)
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    sjf_aging_rate: float = 100.0
    # None: on where it pays (a GPU, whose work runs asynchronously to the host), off on a CPU
    async_scheduling: bool | None = None
    # None: a worker process on a GPU (the loop's host time is the bottleneck there), in the
    # engine's process on a CPU (the forward pass uses every core)
    grammar_process: bool | None = None
    seed: int = 0
    enforce_eager: bool = False
    device: str = "auto"
    load_format: str = "auto"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # None: "mp" with tensor_parallel_size > 1 (a worker process per rank), else "uni"
    distributed_executor_backend: str | None = None
    disable_custom_all_reduce: bool = False
    # mixtures of experts: whole experts split over the tensor-parallel ranks, not each
    # expert's intermediate size, or over the data-parallel engine cores (vLLM's flag)
    enable_expert_parallel: bool = False
    # expert parallelism over data-parallel cores: "allgather_reducescatter" (every core's
    # tokens to every core) or "alltoallv" (each token to its experts' cores only)
    all2all_backend: str = "allgather_reducescatter"
    # dual-batch overlap of expert parallelism over data-parallel cores (vLLM's flags)
    enable_dbo: bool = False
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512
    # decode context parallelism (vLLM's name): a KV head that tensor parallelism copies onto
    # several ranks has its tokens split over N of them instead (N <= tp / num_kv_heads)
    decode_context_parallel_size: int = 1
    cpu_threads: int | None = None
    cpu_threads_bind: str = "none"
    # KV-Compress (``KVCompressConfig``; the fork's flag names)
    enable_kvc: bool = False
    kvc_method: str = "kvcompress"
    max_cache_tokens: int | None = None
    compression_rate: float | None = None
    protected_window_size: int = 32
    compress_once: bool = False
    compression_interval: int = 1
    kvc_num_sinks: int = 0
    prefill_metric_collection_window_size: int = 32
    maxpool_metrics: bool = True
    maxpool_kernel: int = 31  # the max-pooling window of the prefill metric (odd)
    kvc_head_floor: float = 0.0
    # KV connectors beyond KV-Compress, by registered name (core/sched/connector.py)
    kv_connectors: tuple[str, ...] = ()
    # structured outputs (``StructuredOutputsConfig``): the default whitespace of JSON outputs
    structured_outputs_max_whitespace: int = MAX_JSON_WHITESPACE
    structured_outputs_disable_any_whitespace: bool = False  # max_whitespace 0
    # speculative decoding: vLLM's dict (or its JSON text), e.g. {"method": "ngram",
    # "num_speculative_tokens": 4, "prompt_lookup_max": 4}; None: off
    speculative_config: dict | str | SpeculativeConfig | None = None
    # LoRA adapters (``LoRAConfig``, vLLM's flags): adapters loaded at start as 'name=path' or
    # vLLM's JSON; distinct adapters in one step; their largest rank; adapters kept loaded
    enable_lora: bool = False
    lora_modules: list[str | dict | LoRAModulePath] | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        """Validate every argument, load the model's HF config and resolve 'auto' values.

        A lazy factory: the model's files are read through ``model/loader.py``, imported here
        because the model package sits above the config (it imports torch) and importing the
        config must stay cheap."""
        from pagedllm.model.loader import detect_load_format, load_hf_config, resolve_model_path

        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a path to an HF model folder or a .gguf file.")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}.")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}.")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}."
            )
        _positive_int("max_model_len", self.max_model_len, allow_none=True)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}.")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative, got {self.swap_space!r}.")
        cache_dtype = _kv_cache_dtype(self.kv_cache_dtype)
        if self.calculate_kv_scales and self.kv_transfer_config:
            raise ValueError(
                "calculate_kv_scales cannot be combined with kv_transfer_config: each instance "
                "would quantize with scales of its own first prompts; leave the scales fixed."
            )
        offload = self.kv_offloading_size
        if offload is not None and (
            isinstance(offload, bool) or not isinstance(offload, (int, float)) or offload <= 0
        ):
            raise ValueError(f"kv_offloading_size must be a positive GiB count, got {offload!r}.")
        if offload and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size needs enable_prefix_caching=True.")
        transfer = KVTransferConfig.parse(self.kv_transfer_config, self.tensor_parallel_size)
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, got {backend!r}."
            )
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        dp_ep = self.enable_expert_parallel and self.data_parallel_size > 1
        if self.enable_dbo:  # (the parallel fields alone: ParallelConfig checks them)
            others = {"enable_kvc": self.enable_kvc, "speculative_config": self.speculative_config,
                      "kv_offloading_size": self.kv_offloading_size,
                      "kv_transfer_config": self.kv_transfer_config,
                      "kv_connectors": self.kv_connectors}  # fmt: skip
            for name, value in others.items():
                if value:
                    raise ValueError(f"enable_dbo cannot be combined with {name} (yet).")
        if backend is None:
            backend = "mp" if self.tensor_parallel_size > 1 else "uni"
        so_config = self._structured_outputs_config()
        spec_config = self._speculative_config()
        if dp_ep and spec_config is not None and spec_config.method == "draft_model":
            raise ValueError(
                "speculative_config method 'draft_model' cannot be combined with "
                "enable_expert_parallel over data-parallel engine cores (yet): the draft "
                "model's passes are not agreed between the cores; use 'ngram' or 'suffix'."
            )

        device = self.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        if transfer is not None:
            transfer = transfer.with_device(device)
        load_format = detect_load_format(self.model, self.load_format)
        hf_config = load_hf_config(resolve_model_path(self.model, load_format), load_format)
        dtype = _resolve_dtype(self.dtype, hf_config, load_format, device)
        text_config = getattr(hf_config, "text_config", None) or hf_config
        model_max = int(getattr(text_config, "max_position_embeddings", 0) or 2048)
        max_model_len = self.max_model_len or model_max
        if max_model_len > model_max:
            raise ValueError(
                f"max_model_len ({max_model_len}) is larger than the model's "
                f"max_position_embeddings ({model_max})."
            )
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            # vLLM's default with chunked prefill is 2048 (8192 on GPUs for throughput).
            max_num_batched_tokens = 8192 if device == "cuda" else 2048
            if not self.enable_chunked_prefill:
                max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        tokenizer = self.tokenizer or self.model
        model_config = ModelConfig(
            model=self.model,
            tokenizer=tokenizer,
            load_format=load_format,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=self.seed,
            hf_config=hf_config,
            served_model_name=self.served_model_name or os.path.basename(self.model.rstrip("/")),
        )
        _check_tensor_parallel(model_config, self.tensor_parallel_size, bool(self.enable_kvc))
        lora_config = lora_config_from(self, hf_config)
        dcp = self.decode_context_parallel_size
        if dcp != 1:
            self._check_decode_context_parallel(model_config, spec_config)
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
                swap_space_bytes=int(self.swap_space * 2**30),
                kv_offloading_bytes=int((offload or 0) * 2**30),
                kv_transfer=transfer,
                preemption_mode=self.preemption_mode,
                disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager,
                cache_dtype=cache_dtype,
                calculate_kv_scales=self.calculate_kv_scales,
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy,
                sjf_aging_rate=self.sjf_aging_rate,
                # the cores of expert parallelism over data parallelism agree on each step
                # before it runs (engine/dp_sync.py): synchronous steps
                async_scheduling=(
                    device == "cuda" and not dp_ep
                    if self.async_scheduling is None
                    else self.async_scheduling and not dp_ep
                ),
                grammar_process=(
                    device == "cuda" if self.grammar_process is None else self.grammar_process
                ),
            ),
            device_config=DeviceConfig(
                device=device,
                # a core's MoE exchange pads to the step's largest core, which a decode graph
                # of a fixed size cannot follow: eager forward passes
                # (and decode context parallelism: its attention is not graph-captured yet)
                enforce_eager=self.enforce_eager or dp_ep or dcp > 1,
                cpu_threads=self.cpu_threads,
                cpu_threads_bind=self.cpu_threads_bind,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                data_parallel_size=self.data_parallel_size,
                distributed_executor_backend=backend,
                disable_custom_all_reduce=bool(self.disable_custom_all_reduce),
                enable_expert_parallel=bool(self.enable_expert_parallel),
                all2all_backend=self.all2all_backend,
                enable_dbo=bool(self.enable_dbo),
                dbo_decode_token_threshold=self.dbo_decode_token_threshold,
                dbo_prefill_token_threshold=self.dbo_prefill_token_threshold,
                decode_context_parallel_size=self.decode_context_parallel_size,
            ),
            kvc_config=KVCompressConfig(
                enabled=bool(self.enable_kvc),
                method=self.kvc_method,
                max_cache_tokens=self.max_cache_tokens,
                compression_rate=self.compression_rate,
                protected_window_size=self.protected_window_size,
                compress_once=bool(self.compress_once),
                compression_interval=self.compression_interval,
                num_sinks=self.kvc_num_sinks,
                prefill_metric_collection_window_size=self.prefill_metric_collection_window_size,
                maxpool_metrics=bool(self.maxpool_metrics),
                maxpool_kernel=self.maxpool_kernel,
                head_floor=self.kvc_head_floor,
            ),
            kv_connectors=_with_offload(
                parse_names(self.kv_connectors)
                if isinstance(self.kv_connectors, str)
                else tuple(self.kv_connectors),
                bool(offload),
                transfer is not None,
            ),
            structured_outputs_config=so_config,
            speculative_config=spec_config,
            draft_model_config=(
                _draft_model_config(spec_config, model_config)
                if spec_config is not None and spec_config.method == "draft_model"
                else None
            ),
            lora_config=lora_config,
        )

    def _check_decode_context_parallel(
        self, model: ModelConfig, spec: SpeculativeConfig | None
    ) -> None:
        """ValueError naming decode_context_parallel_size unless its ranks hold copies of
        the same KV heads (vLLM's bound: 1 <= dcp <= tp / num_kv_heads, here dcp dividing
        it, so a group of dcp consecutive ranks shares its KV heads) and the engine's other
        features can split a request's tokens over ranks."""
        dcp, tp = self.decode_context_parallel_size, self.tensor_parallel_size
        _positive_int("decode_context_parallel_size", dcp)
        kv = model.num_kv_heads
        if tp % dcp or (kv >= tp and dcp > 1) or (kv < tp and (tp // kv) % dcp):
            raise ValueError(
                f"decode_context_parallel_size ({dcp}) must divide tensor_parallel_size / "
                f"num_kv_heads ({tp} / {kv}): it splits the tokens of a KV head that tensor "
                "parallelism copies onto several ranks, over those ranks."
            )
        others = {  # (KV-Compress needs each KV head on one rank: _check_tensor_parallel)
            # (the built-in host tier and KV transfer move each rank's share of a block)
            "kv_connectors": [n for n in self.kv_connectors if n not in ("offload", "kv_transfer")],
            "enable_dbo": self.enable_dbo,
        }
        if spec is not None:  # the draft model's and the device lookup's own KV writes
            others[f"speculative_config method {spec.method!r}"] = spec.method in (
                "draft_model",
                "ngram_gpu",
            )
        for name, value in others.items():
            if value:
                raise ValueError(
                    f"decode_context_parallel_size > 1 cannot be combined with {name} (yet)."
                )

    def _speculative_config(self) -> SpeculativeConfig | None:
        """The speculative config these arguments ask for (ValueError if invalid, or if it
        cannot run with the other arguments)."""
        spec = self.speculative_config
        if spec is None or isinstance(spec, SpeculativeConfig):
            config = spec
        elif isinstance(spec, str):
            config = SpeculativeConfig.from_json(spec)
        elif isinstance(spec, dict):
            config = SpeculativeConfig.from_dict(spec)
        else:
            raise ValueError(
                f"speculative_config must be a dict or its JSON text, got {type(spec).__name__}."
            )
        if config is None:
            return None
        if self.enable_kvc and config.method in KVC_SPEC_UNSUPPORTED:
            raise ValueError(
                f"speculative_config.method {config.method!r} cannot be combined with "
                f"enable_kvc: {KVC_SPEC_UNSUPPORTED[config.method]}; use 'ngram' or 'suffix'."
            )
        return config

    def _structured_outputs_config(self) -> StructuredOutputsConfig:
        """The structured-outputs defaults these arguments ask for (ValueError if invalid)."""
        flag = self.structured_outputs_disable_any_whitespace
        if not isinstance(flag, bool):
            raise ValueError(
                f"structured_outputs_disable_any_whitespace must be a boolean, got {flag!r}."
            )
        return StructuredOutputsConfig(
            max_whitespace=0 if flag else self.structured_outputs_max_whitespace
        )


# speculative methods KV-Compress cannot verify drafts for, and why (the others: ngram and
# suffix, whose drafts are made on the host; core/sched/kvc.py has the rules)
KVC_SPEC_UNSUPPORTED = {
    "draft_model": "the draft model's KVs would need a cache of their own beside the per-head "
    "one, and its lookahead KVs are not the target's",
    "ngram_gpu": "its drafts are verified on the device after the next step is planned, and "
    "KV-Compress drops the rejected drafts' KVs from what the host knows",
}

# the name the packaged default model is served under when no model is named
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """``EngineArgs`` from the flags that were given (``pagedllm serve`` and ``generate``: an
    absent flag keeps the field's default); the packaged SmolLM2-135M-Instruct when no model is
    named. A lazy factory: the packaged model's path comes from ``model/packaged.py``, looked
    up only when no model is named (the model package sits above the config)."""
    values = {k: v for k, v in vars(ns).items() if k in EngineArgs.field_names()}
    model = getattr(ns, "model_tag", None) or values.get("model")
    if not model:
        from pagedllm.model.packaged import smollm2_gguf_path

        model = smollm2_gguf_path()
        values.setdefault("served_model_name", DEFAULT_MODEL_NAME)
    values["model"] = model
    return EngineArgs(**values)


def _check_tensor_parallel(model: ModelConfig, tp: int, kvc: bool = False) -> None:
    """ValueError naming tensor_parallel_size unless the model's heads split over ``tp``
    ranks: query heads by tp; KV heads by tp, or tp by the KV heads (each KV head then on
    tp / num_kv_heads ranks). KV-Compress (``kvc``) needs the KV heads split by tp: each
    rank evicts from its own KV heads, and a KV head on several ranks would be scored by
    each rank's share of its query heads alone."""
    if tp == 1:
        return
    heads = int(model.text_config.num_attention_heads)
    kv = model.num_kv_heads
    if heads % tp:
        raise ValueError(
            f"tensor_parallel_size ({tp}) must divide the model's {heads} attention heads."
        )
    if kv % tp and tp % kv:
        raise ValueError(
            f"tensor_parallel_size ({tp}) must divide the model's {kv} KV heads or be a "
            "multiple of them."
        )
    if kvc and kv % tp:
        raise ValueError(
            f"enable_kvc needs tensor_parallel_size ({tp}) to divide the model's {kv} KV "
            "heads (each rank evicts from KV heads of its own)."
        )


def _draft_model_config(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The draft model's config: its own weights and HF config, the target's dtype, context
    length and seed (dummy weights when the target's are). ValueError, naming
    ``speculative_config.model``, when it cannot draft for the target: another tokenizer (or
    vocabulary size), or a context shorter than the target's ``max_model_len``. A lazy
    factory, as ``create_engine_config``: the draft's files are read through the model
    package's loader, which sits above the config."""
    from pagedllm.model.loader import (
        detect_load_format,
        load_hf_config,
        load_tokenizer,
        resolve_model_path,
    )

    assert spec.model is not None
    name = f"speculative_config.model ({spec.model!r})"
    try:
        load_format = (
            "dummy" if target.load_format == "dummy" else detect_load_format(spec.model, "auto")
        )
        hf_config = load_hf_config(resolve_model_path(spec.model, load_format), load_format)
    except (OSError, ValueError) as e:
        raise ValueError(f"{name} cannot be loaded: {e}") from None
    text = getattr(hf_config, "text_config", None) or hf_config
    if int(text.vocab_size) != target.vocab_size:
        raise ValueError(
            f"{name} has a vocabulary of {int(text.vocab_size)} tokens, the target model "
            f"{target.vocab_size}: a draft model must use the target's tokenizer."
        )
    draft_max = int(getattr(text, "max_position_embeddings", 0) or 2048)
    if draft_max < target.max_model_len:
        raise ValueError(
            f"{name} has max_position_embeddings {draft_max}, below the target's "
            f"max_model_len {target.max_model_len}; lower max_model_len."
        )
    try:  # both tokenizers where both have one (a dummy model may have none)
        want = load_tokenizer(target.model, target.tokenizer, target.load_format)
        have = load_tokenizer(spec.model, None, load_format)
    except (OSError, ValueError):
        want = have = None
    if want is not None and have is not None and want.get_vocab() != have.get_vocab():
        raise ValueError(f"{name} has another tokenizer than the target model's.")
    return ModelConfig(
        model=spec.model,
        tokenizer=spec.model,
        load_format=load_format,
        dtype=target.dtype,
        max_model_len=target.max_model_len,
        seed=target.seed,
        hf_config=hf_config,
        served_model_name=os.path.basename(spec.model.rstrip("/")),
    )


def _resolve_dtype(dtype: str, hf_config: Any, load_format: str, device: str) -> str:
    aliases = {"float": "float32", "half": "float16"}
    if dtype != "auto":
        return aliases.get(dtype, dtype)
    if load_format == "gguf":
        return "float32" if device == "cpu" else "bfloat16"
    text_config = getattr(hf_config, "text_config", None) or hf_config
    cfg = getattr(text_config, "dtype", None) or getattr(text_config, "torch_dtype", None)
    name = str(cfg).replace("torch.", "") if cfg is not None else "float32"
    if name not in ("float32", "bfloat16", "float16"):
        name = "float32"
    if name == "float16" and device == "cpu":
        name = "bfloat16"  # half-precision matmuls are slow on CPUs; bf16 keeps the range
    if name == "bfloat16" and device == "cpu" and not cpu_has_bf16():
        name = "float32"  # emulated bf16 is slower than float32 on such a CPU
    return name


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX); Linux's
    /proc/cpuinfo flags, False where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False

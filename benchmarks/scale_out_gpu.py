"""Tensor and data parallelism on several GPUs of one host, one device call:

  python benchmarks/scale_out_gpu.py equality --tp 1,2,4     # greedy tokens of TP=N vs TP=1,
                                                           # fp32 tiny models, graphs and eager
  python benchmarks/scale_out_gpu.py allreduce --tp 2,4      # NCCL all-reduce time by tokens
  python benchmarks/scale_out_gpu.py bench-b --tp 1,2,4      # Benchmark B at each TP
  python benchmarks/scale_out_gpu.py bench-b-dp --dp 1,2     # Benchmark B at each DP

Every engine runs in a fresh process of its own (its GPU memory and NCCL group go with it);
the parent collects one JSON line per run and saves after each, so a time limit keeps what ran.
One engine process per TP (or DP) size runs every shape (one start-up each).

Benchmark B (as in gpu_suite.py): Llama-3.1-8B shape, bf16, dummy weights, 1,000 prompts of
random ids, input 128 / output 1,024 and input 1,024 / output 128, ``ignore_eos``, greedy, max
model length 2,048, 256 sequences at most per engine; before each shape's clock a warm-up of
256 prompts of its input length (other ids), 8 output tokens each. The roofline is per GPU:
each step must read the rank's shard of the weights and of the live KV cache (bytes / TP, KV
heads replicated where there are fewer than ranks) at the copy bandwidth measured on GPU 0.

All-reduce time per step: a row-parallel layer all-reduces a [tokens, hidden] bf16 tensor, two
per decoder layer plus one for the vocab-split embedding, and the LM head all-gathers
[sampled rows, vocab / TP]. ``allreduce`` times NCCL's all-reduce of [T, hidden] inside a CUDA
graph (as decode steps replay it) and eagerly for T = 1 .. 8192; the bench run prices each
recorded step at its token count (log-linear interpolation) and reports the mean per step and
its share of the run. (An estimate from the measured collective, not a trace of the engine.)

DP runs go through the async front end the server uses (``MPAsyncLLM`` for DP = 1,
``DPAsyncLLM`` for DP = 2: one front end, N engine core processes, core i on GPU i), all
requests queued at once, final outputs only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIGS = os.path.join(ROOT, "pagedllm", "model", "configs")
SHAPES = {"128x1024": (128, 1024), "1024x128": (1024, 128), "16x8": (16, 8)}  # 16x8: smoke
HIDDEN_8B = 4096


# ------------------------------------------------------------------------------ the parent
def _child(spec: dict, timeout: float) -> dict:
    """Run one measurement in a fresh interpreter; its result dict (or the error)."""
    t = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, __file__, "_one", json.dumps(spec)],
                           capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:  # keep what it said (progress lines) for the log
        said = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        return {"spec": spec, "error": f"timed out after {timeout:.0f} s", "stderr_tail":
                (said or "")[-3000:]}
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        return {"spec": spec, "error": (p.stderr or p.stdout)[-3000:], "rc": p.returncode}
    out = json.loads(lines[-1][len("RESULT "):])
    out["process_wall_s"] = time.perf_counter() - t
    return out


def _save(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def _device_info() -> dict:
    import torch

    if not torch.cuda.is_available():  # a CPU smoke run of the script (gloo)
        return {"benchmark": "scale-out", "device": "cpu", "num_gpus": 0}
    from benchmarks.gpu_suite import provenance

    return {**provenance("scale-out"), "num_gpus": torch.cuda.device_count()}


def _tag(info: dict) -> str:
    return f"{info['device'].replace(' ', '_')}_x{info['num_gpus']}"


def main_equality(args: argparse.Namespace) -> None:
    info = _device_info()
    path = os.path.join(args.out, f"scale_out_equality_{_tag(info)}.json")
    result = {**info, "runs": []}
    # (arch, config overrides, eager): the tiny llama has 4 heads and 2 KV heads (KV heads
    # replicated at TP 4); the 8-head one splits its 8 KV heads at every size
    eight = {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 8}
    cases = [("llama", {}, False), ("llama", eight, False), ("llama", {}, True),
             ("qwen3", {}, False), ("gemma3", {}, False)]
    if args.cases:  # a subset, by index (what an earlier call did not reach)
        cases = [cases[int(i)] for i in args.cases.split(",")]
    for arch, overrides, eager in cases:
        spec = {"kind": "equality", "arch": arch, "overrides": overrides,
                "tps": [int(t) for t in args.tp], "eager": eager, "device": args.device}
        r = _child(spec, 600)
        result["runs"].append(r)
        print(json.dumps(r), flush=True)
        _save(path, result)
    ok = all(r.get("equal") for r in result["runs"])
    result["all_equal"] = ok
    _save(path, result)
    print("wrote", path, "all_equal", ok)


def main_allreduce(args: argparse.Namespace) -> None:
    info = _device_info()
    path = os.path.join(args.out, f"scale_out_allreduce_{_tag(info)}.json")
    result = {**info, "hidden": HIDDEN_8B, "dtype": "bfloat16", "by_tp": {}}
    for tp in map(int, args.tp):
        r = _child({"kind": "allreduce", "tp": tp, "hidden": HIDDEN_8B}, 100)
        result["by_tp"][str(tp)] = r
        print(json.dumps(r), flush=True)
        _save(path, result)
    print("wrote", path)


def main_bench(args: argparse.Namespace, dp_mode: bool) -> None:
    info = _device_info()
    name = "dp" if dp_mode else "tp"
    path = os.path.join(args.out, f"scale_out_bench-b_{name}_{_tag(info)}.json")
    result: dict = {**info, "benchmark": "B-llama8b scale-out", "num_prompts": args.num,
                    "runs": {}}
    if os.path.exists(path):  # a later call adds to the same file
        with open(path) as f:
            result["runs"] = json.load(f).get("runs", {})
    ar = None
    ar_path = os.path.join(args.out, f"scale_out_allreduce_{_tag(info)}.json")
    if os.path.exists(ar_path):
        with open(ar_path) as f:
            ar = json.load(f)["by_tp"]
    for size in args.dp if dp_mode else args.tp:  # one engine process per size, every shape
        n = int(size)
        spec = {"kind": "bench", "shapes": args.shapes, "num": args.num, "warm": args.warm,
                "model": args.model, "device": args.device,
                "backend": args.backend if n == 1 else "mp",
                "tp": 1 if dp_mode else n, "dp": n if dp_mode else 0,
                "allreduce": (ar or {}).get(str(n)) if not dp_mode else None}
        r = _child(spec, args.run_timeout)
        for shape in args.shapes:
            run = r.get(shape, {"error": r.get("error"), "spec": spec})
            run.update({k: v for k, v in r.items() if k not in SHAPES})
            key = f"{shape}_{name}{n}"
            if n == 1 and not dp_mode and args.backend != "uni":
                key += f"_{args.backend}"
            result["runs"][key] = run
            print(json.dumps({k: v for k, v in run.items() if k != "spec"})[:1500], flush=True)
        _save(path, result)
    base = name + "1"
    for shape in SHAPES:
        b = result["runs"].get(f"{shape}_{base}", {}).get("output_tokens_per_s")
        for key, r in result["runs"].items():
            if key.startswith(shape + "_") and b and r.get("output_tokens_per_s"):
                r[f"speedup_vs_{base}"] = r["output_tokens_per_s"] / b
    _save(path, result)
    print("wrote", path)


# ------------------------------------------------------------------------------ one run
def _tiny(arch: str, overrides: dict) -> str:
    from tests.models.tiny import make_tiny_model

    tag = "_".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    return make_tiny_model(arch, f"/tmp/scale_out_tiny/{arch}{tag}", **overrides)


def one_equality(spec: dict) -> dict:
    from pagedllm import LLM, SamplingParams

    path = _tiny(spec["arch"], spec["overrides"])
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, int(n)).tolist()}
               for n in (9, 17, 33, 64, 100, 150)]
    prompts.append({"prompt_token_ids": prompts[3]["prompt_token_ids"] + [7, 8, 9]})  # a hit
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    got: dict = {}
    for tp in spec["tps"]:
        llm = LLM(path, dtype="float32", device=spec["device"], max_model_len=512,
                  tensor_parallel_size=tp, kv_cache_memory_bytes=64 << 20,
                  max_num_batched_tokens=64, enforce_eager=spec["eager"])
        outs = llm.generate(prompts, sp, use_tqdm=False)
        # and without logprobs: greedy rows then take LMHead.argmax's path at TP > 1 (each
        # rank's (max, id), not the gathered logits)
        plain = llm.generate(prompts, replace(sp, logprobs=None), use_tqdm=False)
        got[tp] = ([list(o.outputs[0].token_ids) for o in outs],
                   [[d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                    for o in outs],
                   [list(o.outputs[0].token_ids) for o in plain])
        llm.llm_engine.engine_core.shutdown()  # its worker processes and their GPU memory
        del llm
    t1, lp1, _ = got[spec["tps"][0]]
    res = {"arch": spec["arch"], "overrides": spec["overrides"], "eager": spec["eager"],
           "tps": spec["tps"], "num_prompts": len(prompts), "max_tokens": 32, "equal": True,
           "by_tp": {}}
    for tp in spec["tps"][1:]:
        toks, lps, greedy = got[tp]
        same = toks == t1
        diff = max(abs(a - b) for x, y in zip(lp1, lps) for a, b in zip(x, y)) if same else None
        res["by_tp"][str(tp)] = {"tokens_equal": same, "max_abs_logprob_diff": diff,
                                 "argmax_path_tokens_equal": greedy == t1}
        res["equal"] = res["equal"] and same and greedy == t1
    return res


def _ar_worker(rank: int, world: int, port: int, hidden: int, q) -> None:  # noqa: ANN001
    """One rank: all-reduce [T, hidden] bf16 for each T, eagerly and (on GPUs) replayed from
    a CUDA graph of ``n`` all-reduces; rank 0 puts {T: microseconds} on ``q``. (On a CPU,
    gloo and no graphs: a smoke run of the logic.)"""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(rank)
    t0 = time.perf_counter()
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=60))
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    out = {}
    for t in (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192):
        print(f"rank {rank} tokens {t} at {time.perf_counter() - t0:.1f} s", file=sys.stderr,
              flush=True)
        x = torch.zeros(t, hidden, device="cuda" if gpu else "cpu", dtype=torch.bfloat16)
        for _ in range(5):
            dist.all_reduce(x)
        sync()
        n = 50
        start = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x)
        sync()
        row = {"eager_us": (time.perf_counter() - start) * 1e6 / n}
        if gpu:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(n):
                    dist.all_reduce(x)
            g.replay()
            sync()
            start = time.perf_counter()
            g.replay()
            sync()
            row["graph_us"] = (time.perf_counter() - start) * 1e6 / n
        out[t] = row
    if rank == 0:
        q.put(out)
    # no dist.barrier() here: it can hang after every size is timed, and the stage's limit
    # then kills the run with nothing saved; every rank has finished its collectives at this
    # point (the last graph replay was synchronized)
    dist.destroy_process_group()


def one_allreduce(spec: dict) -> dict:
    import torch.multiprocessing as mp

    from pagedllm.utils.net import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_ar_worker, args=(r, spec["tp"], port, spec["hidden"], q))
             for r in range(spec["tp"])]
    for p in procs:
        p.start()
    out = q.get(timeout=120)
    for p in procs:
        p.join(60)
    return {"tp": spec["tp"], "us_by_tokens": out}


def _ar_us(table: dict | None, tokens: int, key: str = "graph_us") -> float:
    """The all-reduce time at ``tokens`` rows, log-linear between the measured points."""
    if not table or "us_by_tokens" not in table:
        return 0.0
    pts = sorted((int(t), v.get(key, v["eager_us"])) for t, v in table["us_by_tokens"].items())
    xs, ys = np.log([p[0] for p in pts]), [p[1] for p in pts]
    return float(np.interp(np.log(max(tokens, 1)), xs, ys))


def analytic_cost(config_path: str, tp: int, elem: int = 2):  # noqa: ANN201
    """The per-GPU ModelCost of a Llama-shaped model at tensor-parallel size ``tp``: the
    rank's shard of every weight (norms replicated), of the KV heads (one per rank where
    there are fewer KV heads than ranks) and of the attention FLOPs."""
    from pagedllm.bench.roofline import ModelCost

    with open(config_path) as f:
        c = json.load(f)
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    nh, nkv, vocab = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    hd = c.get("head_dim") or h // nh
    kv_rank = max(nkv // tp, 1)
    per_layer = (h * nh * hd // tp + 2 * h * kv_rank * hd + nh * hd * h // tp
                 + 3 * h * inter // tp + 2 * h)
    lm_head = 0 if c.get("tie_word_embeddings") else vocab * h // tp
    params = layers * per_layer + vocab * h // tp + lm_head + h
    return ModelCost(params * elem, params, 2 * layers * kv_rank * hd * elem,
                     4 * layers * (nh // tp) * hd)


def _prompts(n: int, n_in: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab, size=n_in).tolist() for _ in range(n)]


def one_bench(spec: dict) -> dict:
    """One engine (TP = spec["tp"] in-process, or DP = spec["dp"] behind the async front end)
    timed on every shape of ``spec["shapes"]``: {shape: result, "startup_s": ...}."""
    import torch

    from pagedllm.bench.roofline import measure_copy_bandwidth, measure_matmul_flops

    device = spec.get("device", "cuda")
    gpu = device == "cuda"
    bw = measure_copy_bandwidth(torch.device(device))
    flops = measure_matmul_flops(torch.device(device)) if gpu else 1e12
    if gpu:
        torch.cuda.empty_cache()
    vocab = 128000 if gpu else 500  # (a CPU smoke run uses a tiny model)
    kw = dict(load_format="dummy", dtype="bfloat16" if gpu else "float32",
              max_model_len=2048 if gpu else 256, max_num_seqs=256, device=device)
    if gpu:
        kw["gpu_memory_utilization"] = 0.85
    else:
        kw["kv_cache_memory_bytes"] = 64 << 20
    res: dict = {"tp": spec["tp"], "dp": spec["dp"] or 1, "num_prompts": spec["num"],
                 "copy_bandwidth_GBps": bw / 1e9, "matmul_bf16_TFLOPs": flops / 1e12}
    run = _bench_dp if spec["dp"] else _bench_tp
    res.update(run(spec, kw, vocab, bw, flops))
    return res


def _bench_tp(spec: dict, kw: dict, vocab: int, bw: float, flops: float) -> dict:
    import torch

    from pagedllm import LLM, SamplingParams
    from pagedllm.bench.roofline import model_cost, roofline
    from pagedllm.bench.throughput import StepRecorder

    model, tp, num = kw_model(spec), spec["tp"], spec["num"]
    t = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp,
              distributed_executor_backend=spec.get("backend", "uni" if tp == 1 else "mp"),
              **kw)
    out: dict = {"startup_s": time.perf_counter() - t}
    core = llm.llm_engine.engine_core
    elem = 2 if kw["dtype"] == "bfloat16" else 4
    config = model if os.path.isdir(model) else os.path.join(CONFIGS, model)
    cost = analytic_cost(os.path.join(config, "config.json"), tp, elem)
    if tp == 1 and spec.get("backend", "uni") == "uni":  # the runner's own cost at TP = 1
        real = model_cost(core.model_runner.model, getattr(torch, kw["dtype"]))
        out["analytic_cost_check"] = {"analytic_params": cost.num_params,
                                      "model_params": real.num_params,
                                      "analytic_kv": cost.kv_bytes_per_token,
                                      "model_kv": real.kv_bytes_per_token}
    out["kv_cache_blocks"] = core.scheduler.kv_cache_manager.block_pool.num_blocks
    rec = StepRecorder(llm)  # wraps the scheduler once; cleared before each timed run
    for shape in spec["shapes"]:
        n_in, n_out = SHAPES[shape]
        # warm-up: the full batch of 256 on other ids (prefill and decode shapes compile
        # before the clock), a few output tokens each
        warm = _prompts(spec["warm"], n_in, vocab, seed=1)
        llm.generate([{"prompt_token_ids": p} for p in warm],
                     SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                     use_tqdm=False)
        core.scheduler.kv_cache_manager.reset_prefix_cache()
        steps = rec.steps  # each timed step's shape, for the roofline
        steps.clear()
        prompts = _prompts(num, n_in, vocab, seed=0)
        sp = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        el = time.perf_counter() - t
        assert sum(len(o.outputs[0].token_ids) for o in outs) == num * n_out
        roof = roofline(steps, cost, bw, flops)
        ar_us = [(2 * 32 + 1) * _ar_us(spec.get("allreduce"), sum(s.num_tokens)) for s in steps]
        out[shape] = {
            "shape": shape, "elapsed_s": el, "output_tokens_per_s": num * n_out / el,
            "total_tokens_per_s": num * (n_in + n_out) / el, "steps": len(steps),
            "decode_steps": roof.decode_steps,
            "mean_batch": float(np.mean([len(s.num_tokens) for s in steps])),
            "ms_per_step": 1e3 * el / max(len(steps), 1),
            "roofline_per_gpu_output_tokens_per_s": num * n_out / roof.ideal_s,
            "roofline_fraction_per_gpu": roof.ideal_s / el,
            "allreduce_ms_per_step_est": float(np.mean(ar_us)) / 1e3 if tp > 1 else 0.0,
            "allreduce_share_of_run_est": float(np.sum(ar_us)) / 1e6 / el if tp > 1 else 0.0,
        }
        core.scheduler.kv_cache_manager.reset_prefix_cache()
    return out


def kw_model(spec: dict) -> str:
    return spec.get("model", "llama-3.1-8b")


def _bench_dp(spec: dict, kw: dict, vocab: int, bw: float, flops: float) -> dict:
    import asyncio

    from pagedllm import SamplingParams
    from pagedllm.config import EngineArgs
    from pagedllm.engine.dp_async_llm import DPAsyncLLM
    from pagedllm.engine.mp_async_llm import MPAsyncLLM

    args = EngineArgs(model=kw_model(spec), data_parallel_size=spec["dp"], **kw)
    t = time.perf_counter()
    llm = (DPAsyncLLM if spec["dp"] > 1 else MPAsyncLLM).from_engine_args(args)
    out: dict = {"startup_s": time.perf_counter() - t, "front_end": type(llm).__name__}

    async def one(p: list[int], sp: SamplingParams) -> int:
        stream = await llm.add_request({"prompt_token_ids": p}, sp, output_kind="final")
        n = 0
        async for o in stream:
            n = len(o.outputs[0].token_ids)
        return n

    async def run(ps: list, sp: SamplingParams) -> tuple[float, int]:
        t = time.perf_counter()
        ns = await asyncio.gather(*(one(p, sp) for p in ps))
        return time.perf_counter() - t, sum(ns)

    async def every_shape() -> None:
        await llm.start()
        for shape in spec["shapes"]:
            n_in, n_out = SHAPES[shape]
            await run(_prompts(spec["warm"], n_in, vocab, seed=1),
                      SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            before = list(llm.router.routed) if hasattr(llm, "router") else None
            prompts = _prompts(spec["num"], n_in, vocab, seed=0)
            el, n_tok = await run(prompts, SamplingParams(temperature=0, max_tokens=n_out,
                                                          ignore_eos=True))
            assert n_tok == len(prompts) * n_out, n_tok
            routed = ([a - b for a, b in zip(llm.router.routed, before)]
                      if before is not None else None)
            out[shape] = {"shape": shape, "elapsed_s": el, "output_tokens_per_s": n_tok / el,
                          "total_tokens_per_s": len(prompts) * (n_in + n_out) / el,
                          "requests_per_core": routed}

    try:
        asyncio.run(every_shape())
    finally:
        llm.shutdown()
    return out


def main() -> None:
    if sys.argv[1] == "_one":
        spec = json.loads(sys.argv[2])
        fn = {"equality": one_equality, "allreduce": one_allreduce, "bench": one_bench}
        print("RESULT " + json.dumps(fn[spec["kind"]](spec)), flush=True)
        return
    p = argparse.ArgumentParser()
    p.add_argument("part", choices=["equality", "allreduce", "bench-b", "bench-b-dp"])
    sizes = lambda s: s.split(",")  # noqa: E731
    p.add_argument("--tp", type=sizes, default=["1", "2"],
                   help="TP sizes")
    p.add_argument("--dp", type=sizes, default=["1", "2"])
    p.add_argument("--shapes", type=lambda s: s.split(","), default=["128x1024", "1024x128"])
    p.add_argument("--num", type=int, default=1000)
    p.add_argument("--warm", type=int, default=256)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="llama-3.1-8b", help="(a tiny model dir: CPU smoke run)")
    p.add_argument("--run-timeout", type=float, default=420)
    p.add_argument("--cases", default="", help="equality: the cases to run, by index (0-4)")
    p.add_argument("--backend", default="uni", choices=["uni", "mp"],
                   help="executor of the TP = 1 runs (TP > 1 always runs worker processes)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = p.parse_args()
    if args.part == "equality":
        main_equality(args)
    elif args.part == "allreduce":
        main_allreduce(args)
    else:
        main_bench(args, args.part == "bench-b-dp")


if __name__ == "__main__":
    main()

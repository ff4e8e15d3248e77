"""The GPU check and Benchmarks A and B, one part per device call:

  python benchmarks/gpu_suite.py check   # greedy equality vs HF (fp32 exact, bf16 close),
                                         # CUDA graphs on and off, Qwen3-0.6B shape
  python benchmarks/gpu_suite.py bench-a # Benchmark A + HF peers + roofline
  python benchmarks/gpu_suite.py bench-b # Benchmark B (Llama-3.1-8B shape) + HF peers
  python benchmarks/gpu_suite.py extras  # prefix-caching overhead at 0% hit and its gain on
                                         # shared prefixes; structured-output overhead
  python benchmarks/gpu_suite.py extras --only-structured   # structured outputs only

Results: JSON (and PNG) under --out (default benchmarks/results), named with the device.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.peers import hf_gpu  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.bench.kernel_table import kernel_kind  # noqa: E402
from pagedllm.bench.roofline import (  # noqa: E402
    measure_copy_bandwidth,
    measure_matmul_flops,
    model_cost,
    roofline,
)
from pagedllm.bench.throughput import StepRecorder, make_workload  # noqa: E402
from pagedllm.worker.profiler import DeviceTimer  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "pagedllm", "model", "configs")


def provenance(benchmark: str) -> dict:
    """The fields every result file carries: what ran, on what, from which commit."""
    import subprocess

    import triton

    # the device machine's copy of the tree may carry a stale .git: the caller names the
    # commit it sent in PAGEDLLM_COMMIT
    commit = os.environ.get("PAGEDLLM_COMMIT")
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                          text=True, check=False).stdout.strip() or None
    except OSError:
        commit = None
    return {"benchmark": benchmark, "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__, "triton": triton.__version__, "git_commit": commit}


def device_tag() -> str:
    return torch.cuda.get_device_name(0).replace(" ", "_")


def make_hf_model(
    shape: str, dtype: torch.dtype, path: str, seed: int = 0, overrides: dict | None = None
) -> str:
    """Random-weight HF model of a real shape saved as safetensors, so pagedllm and HF load
    the very same weights; ``overrides`` replace config fields."""
    import transformers as tf

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    config = tf.AutoConfig.from_pretrained(os.path.join(CONFIGS, shape))
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return path


def free_mem() -> None:
    gc.unfreeze()  # (the engine core freezes the heap: frozen cycles are never collected)
    gc.collect()
    torch.cuda.empty_cache()


def check(args: argparse.Namespace) -> dict:
    import transformers as tf

    out: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 150000, size=int(n)).tolist() for n in (17, 64, 150, 333)]
    for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        path = make_hf_model("qwen3-0.6b", dtype, f"/tmp/qwen3_{dtype_name}")
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
        model.generation_config.eos_token_id = None
        ref, ref_lp = [], []
        for p in prompts:
            with torch.no_grad():
                g = model.generate(torch.tensor([p]).cuda(), max_new_tokens=32, do_sample=False,
                                   output_logits=True, return_dict_in_generate=True,
                                   pad_token_id=0)
            ref.append(g.sequences[0, len(p):].tolist())
            ref_lp.append([lg[0].float().log_softmax(-1).cpu() for lg in g.logits])
        del model
        free_mem()
        for mode, kw in (("graphs", {}), ("eager", {"enforce_eager": True}),
                         ("graphs_sync", {"async_scheduling": False})):
            llm = LLM(path, dtype=dtype_name, max_model_len=1024, gpu_memory_utilization=0.5,
                      max_num_seqs=16, **kw)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                               logprobs=5), use_tqdm=False)
            got = [o.outputs[0].token_ids for o in outs]
            exact = sum(g == r for g, r in zip(got, ref))
            first = [sum(1 for _ in _prefix(g, r)) for g, r in zip(got, ref)]
            lp_err = 0.0
            gaps = []  # at each first divergence: HF's logprob of its token minus of ours
            for o, lps, r in zip(outs, ref_lp, ref):
                for pos, d in enumerate(o.outputs[0].logprobs):
                    tok = o.outputs[0].token_ids[pos]
                    if tok != r[pos]:
                        gaps.append(float(lps[pos][r[pos]] - lps[pos][tok]))
                        break
                    lp_err = max(lp_err, abs(d[tok].logprob - float(lps[pos][tok])))
            out[f"{dtype_name}_{mode}"] = {
                "sequences_equal": f"{exact}/{len(ref)}", "matching_prefix_tokens": first,
                "max_logprob_abs_err_on_matching_prefix": lp_err,
                # a near tie that bf16 rounding flips shows a gap within the logprob error
                "hf_logprob_gap_at_first_divergence": gaps,
            }
            del llm
            free_mem()
    return out


def _prefix(a: list[int], b: list[int]):  # noqa: ANN202
    for x, y in zip(a, b):
        if x != y:
            return
        yield x


def save_partial(args: argparse.Namespace, part: str, result: dict) -> None:
    """Write what a long run has measured so far (a time limit may cut the run short)."""
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"gpu_{part}_{device_tag()}.partial.json"), "w") as f:
        json.dump(result, f, indent=2)


def phase_split(steps: list, dev: list[float], cost, bw: float, flops: float) -> dict | None:
    """Device time vs ideal time of the decode-only steps and of the steps with a prefill chunk
    (steps and device times are recorded one per step, in order)."""
    if not dev or len(dev) != len(steps):
        return None
    out = {}
    for phase, pick in (("decode", lambda s: max(s.num_tokens) == 1),
                        ("prefill", lambda s: max(s.num_tokens) > 1)):
        idx = [i for i, s in enumerate(steps) if pick(s)]
        roof = roofline([steps[i] for i in idx], cost, bw, flops)
        device_s = float(sum(dev[i] for i in idx))
        out[phase] = {"steps": len(idx), "device_s": device_s, "ideal_s": roof.ideal_s,
                      "memory_s": roof.memory_s, "compute_s": roof.compute_s,
                      "fraction": roof.ideal_s / device_s if device_s else None}
    return out


def kernel_profile(llm, prompts: list, params: list) -> dict:  # noqa: ANN001
    """Device time of one run of the workload by kernel kind (torch.profiler with CUPTI: the
    kernels inside CUDA graphs are traced one by one), and the top kernels by name."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    el = time.perf_counter() - t
    kinds: dict[str, float] = {}
    top = []
    for e in prof.key_averages():
        ms = e.self_device_time_total / 1e3
        if ms <= 0:
            continue
        kind = kernel_kind(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + ms
        top.append((ms, e.count, e.key[:90]))
    top.sort(reverse=True)
    total = sum(kinds.values())
    return {"profiled_elapsed_s": el, "device_ms_total": total,
            "by_kind_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top": [{"ms": ms, "count": c, "name": k} for ms, c, k in top[:30]]}


def model_cost_hf(model) -> int:  # noqa: ANN001
    """K/V bytes per token of an HF causal LM (all layers, K and V)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * model.dtype.itemsize


def bench_a(args: argparse.Namespace) -> dict:
    """Qwen3-0.6B shape, bf16, 256 prompts, input and output lengths uniform in 100-1024."""
    path = make_hf_model("qwen3-0.6b", torch.bfloat16, "/tmp/qwen3_bfloat16")
    n = args.num_prompts
    prompts, out_lens = make_workload(n, 562, 562, 462 / 562, 151936, seed=0)
    result: dict = {**provenance("A-nano-vllm"),
                    "workload": {"model": "qwen3-0.6b shape, random weights, bf16",
                                 "num_prompts": n, "input_len": "100-1024",
                                 "output_len": "100-1024", "ignore_eos": True,
                                 "input_tokens": sum(map(len, prompts)),
                                 "output_tokens": sum(out_lens)}}
    bw = measure_copy_bandwidth(torch.device("cuda"))
    flops = measure_matmul_flops(torch.device("cuda"))
    result["copy_bandwidth_GBps"] = bw / 1e9
    result["matmul_bf16_TFLOPs"] = flops / 1e12
    variants = [("cuda_graphs", {})]  # the default engine: CUDA graphs, async scheduling
    if args.sync_too:
        variants.append(("cuda_graphs_sync", {"async_scheduling": False}))
    if args.eager_too:
        variants.append(("eager", {"enforce_eager": True}))
    for name, kw in variants:
        llm = LLM(path, dtype="bfloat16", max_model_len=2048, max_num_seqs=256,
                  gpu_memory_utilization=0.85, **kw)
        # Warm-up: the same lengths with other token ids (no prefix-cache hits later), so every
        # Triton specialization the workload meets is compiled before the timed run.
        warm, _ = make_workload(n, 562, 562, 462 / 562, 151936, seed=1)
        warm = [w[: len(p)] + [7] * (len(p) - len(w)) for w, p in zip(warm, prompts)]
        llm.generate([{"prompt_token_ids": p} for p in warm],
                     [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                      for m in out_lens], use_tqdm=False)
        rec = StepRecorder(llm)
        runner = llm.llm_engine.engine_core.model_runner
        timer = runner.profiler = DeviceTimer() if args.time_device else None
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                             for m in out_lens], use_tqdm=False)
        torch.cuda.synchronize()
        el = time.perf_counter() - t
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        roof = roofline(rec.steps, model_cost(runner.model, torch.bfloat16), bw, flops)
        dev = timer.step_seconds if timer is not None else []
        runner.profiler = None
        split = phase_split(rec.steps, dev, model_cost(runner.model, torch.bfloat16), bw, flops)
        result[f"pagedllm_{name}"] = {
            "engine_args": kw,
            "async_scheduling": llm.llm_engine.config.scheduler_config.async_scheduling,
            "wall_ms_per_step": 1e3 * el / max(len(rec.steps), 1),
            # device time from a CUDA event before the forward to one after sampling
            "device_ms_per_step": 1e3 * float(np.mean(dev)) if dev else None,
            "device_busy_fraction": float(np.sum(dev)) / el if dev else None,
            "elapsed_s": el, "output_tokens": produced, "output_tokens_per_s": produced / el,
            "total_tokens_per_s": (produced + sum(map(len, prompts))) / el,
            "requests_per_s": n / el, "kv_cache_blocks": runner.num_blocks,
            "steps": len(rec.steps),
            "host_ms_per_decode_step": 1e3 * float(np.mean(rec.decode_host_s or [0])),
            "max_decode_batch": max((len(s.num_tokens) for s in rec.steps
                                     if max(s.num_tokens) == 1), default=0),
            "roofline_ideal_s": roof.ideal_s, "roofline_memory_s": roof.memory_s,
            "roofline_compute_s": roof.compute_s, "roofline_fraction": roof.ideal_s / el,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
            "phases": split,
        }
        if args.profile and name == "cuda_graphs":
            again, _ = make_workload(n, 562, 562, 462 / 562, 151936, seed=2)
            again = [w[: len(p)] + [9] * (len(p) - len(w)) for w, p in zip(again, prompts)]
            result["kernel_profile"] = kernel_profile(
                llm, [{"prompt_token_ids": p} for p in again],
                [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in out_lens])
        print(json.dumps(result, indent=1), flush=True)
        save_partial(args, "bench-a", result)
        del llm, rec, runner  # the runner holds the KV cache: the next engine sizes its own
        free_mem()
    if not args.skip_peers:
        model = hf_gpu.load(path, torch.bfloat16)
        sub = args.peer_prompts or n
        # static batches as large as fit: at most 256, K/V of a full batch in half the free
        # memory (on an 80 GB card 256 x 2048 tokens of this model's K/V do not fit)
        kv_token = model_cost_hf(model)
        free = torch.cuda.mem_get_info()[0]
        static_batch = 256
        while static_batch > 1 and static_batch * 2048 * kv_token > free / 2:
            static_batch //= 2
        static = functools.partial(hf_gpu.static_generate, batch_size=static_batch)
        for name, fn in (("hf_continuous_batching", hf_gpu.continuous_batching),
                         ("hf_static_generate", static)):
            try:
                r = fn(model, prompts[:sub], out_lens[:sub])
                r["num_prompts"] = sub
                if name == "hf_static_generate":
                    r["batch_size"] = static_batch
                result[name] = r
            except Exception as e:  # a peer failing must not lose the other results
                result[name] = {"error": repr(e)[:500]}
            print(json.dumps({name: result[name]}, indent=1), flush=True)
            save_partial(args, "bench-a", result)
            free_mem()
    ours = result["pagedllm_cuda_graphs"]["output_tokens_per_s"]
    result["model"] = "qwen3-0.6b"
    result["output_tokens_per_s"] = ours
    result["total_tokens_per_s"] = result["pagedllm_cuda_graphs"]["total_tokens_per_s"]
    ideal = result["pagedllm_cuda_graphs"]["roofline_ideal_s"]
    result["roofline_output_tokens_per_s"] = result["workload"]["output_tokens"] / ideal
    result["peers"] = {
        "hf_generate_batch": result.get("hf_continuous_batching", {}).get("output_tokens_per_s"),
        "hf_generate": result.get("hf_static_generate", {}).get("output_tokens_per_s"),
    }
    for name in ("hf_continuous_batching", "hf_static_generate"):
        peer = result.get(name, {})
        if "output_tokens_per_s" in peer:
            result[f"ratio_vs_{name}"] = ours / peer["output_tokens_per_s"]
    return result


def _b_label(model: str) -> str:
    """Benchmark B's label: "B-llama8b" for its own shape, "B-<shape>" for another (--b-model,
    e.g. the mixture of experts qwen3-30b-a3b)."""
    return "B-llama8b" if model == "llama-3.1-8b" else f"B-{model}"


def bench_b(args: argparse.Namespace) -> dict:
    """Llama-3.1-8B shape (or --b-model's), bf16, 1,000 prompts: input 1024 / output 128 and
    input 128 / output 1024. pagedllm builds the random weights itself (--load-format dummy);
    the HF peers run the same shape with HF's own random init (speed does not depend on the
    values) on a subset."""
    result: dict = {**provenance(_b_label(args.b_model)), "model": args.b_model}
    bw = measure_copy_bandwidth(torch.device("cuda"))
    flops = measure_matmul_flops(torch.device("cuda"))
    result["copy_bandwidth_GBps"] = bw / 1e9
    result["matmul_bf16_TFLOPs"] = flops / 1e12
    shapes = [(1024, 128), (128, 1024)]
    if args.b_shapes:
        shapes = [tuple(map(int, x.split("x"))) for x in args.b_shapes.split(",")]
    _bench_b_engine(args, result, shapes, bw, flops)
    if not args.skip_peers:
        model = hf_peer(args.b_model)
        for n_in, n_out in shapes:
            rng = np.random.default_rng(0)
            sub = [rng.integers(100, 128000, size=n_in).tolist() for _ in range(args.peer_b)]
            for name, fn in (("hf_continuous_batching", hf_gpu.continuous_batching),
                             ("hf_static_generate", hf_gpu.static_generate)):
                try:
                    r = fn(model, sub, [n_out] * len(sub))
                    r["num_prompts"] = len(sub)
                except Exception as e:
                    r = {"error": repr(e)[:300]}
                result[f"in{n_in}_out{n_out}"][name] = r
                print(json.dumps({name: r}), flush=True)
                save_partial(args, "bench-b", result)
                free_mem()
    return result


def hf_peer(shape: str):  # noqa: ANN201
    """HF transformers' model of a built-in shape (``pagedllm/model/configs``), random bf16
    weights on the GPU (``_hf_random``), generating past any EOS: Benchmark B's peer."""
    import transformers as tf

    model = _hf_random(tf, tf.AutoConfig.from_pretrained(os.path.join(CONFIGS, shape)))
    model.generation_config.eos_token_id = None
    return model


def _hf_random(tf, config):  # noqa: ANN001, ANN202
    """HF's model of ``config`` on the GPU in bf16 with random weights, built without its
    init's temporaries (a 30B mixture of experts must fit beside nothing else on 80 GB):
    allocated empty, every parameter drawn in place, the rotary buffers made anew."""
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cuda").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for module in model.modules():
            if hasattr(module, "inv_freq"):  # rotary embeddings: buffers, not parameters
                fresh = type(module)(config=config).to("cuda")
                for name, buf in fresh.named_buffers(recurse=False):
                    setattr(module, name, buf)
    print(f"HF peer: {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated", flush=True)
    return model


def _bench_b_engine(args, result, shapes, bw, flops) -> None:  # noqa: ANN001
    llm = LLM(args.b_model, load_format="dummy", dtype="bfloat16", max_model_len=2048,
              max_num_seqs=256, gpu_memory_utilization=0.85)
    for n_in, n_out in shapes:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(100, 128000, size=n_in).tolist() for _ in range(args.num_b)]
        # warm-up: the same lengths on other token ids, enough requests to reach the full
        # batch, so the Triton specializations of these shapes compile before the clock starts
        # (--warm-out: short outputs that still reach the full batch)
        warm = [rng.integers(100, 128000, size=n_in).tolist() for _ in range(args.warm_b)]
        llm.generate([{"prompt_token_ids": p} for p in warm],
                     SamplingParams(temperature=0, max_tokens=min(n_out, args.warm_out or n_out),
                                    ignore_eos=True),
                     use_tqdm=False)  # fmt: skip
        llm.llm_engine.engine_core.scheduler.kv_cache_manager.reset_prefix_cache()
        rec = StepRecorder(llm)
        runner = llm.llm_engine.engine_core.model_runner
        timer = runner.profiler = DeviceTimer()
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True),
                     use_tqdm=False)
        torch.cuda.synchronize()
        el = time.perf_counter() - t
        cost = model_cost(runner.model, torch.bfloat16)
        roof = roofline(rec.steps, cost, bw, flops)
        dev = timer.step_seconds
        runner.profiler = None
        n_tok = args.num_b * n_out
        result[f"in{n_in}_out{n_out}"] = {
            "num_prompts": args.num_b, "elapsed_s": el, "output_tokens_per_s": n_tok / el,
            "total_tokens_per_s": args.num_b * (n_in + n_out) / el,
            "roofline_output_tokens_per_s": n_tok / roof.ideal_s,
            "roofline_fraction": roof.ideal_s / el, "steps": len(rec.steps),
            "host_ms_per_decode_step": 1e3 * float(np.mean(rec.decode_host_s or [0])),
            "device_ms_per_step": 1e3 * float(np.mean(dev)) if dev else None,
            "device_busy_fraction": float(np.sum(dev)) / el if dev else None,
            "kv_cache_blocks": runner.num_blocks,
            "phases": phase_split(rec.steps, dev, cost, bw, flops),
        }
        print(json.dumps(result, indent=1), flush=True)
        save_partial(args, "bench-b", result)
        llm.llm_engine.engine_core.scheduler.kv_cache_manager.reset_prefix_cache()
    del llm, rec, runner
    free_mem()


def split_b(result: dict) -> dict[str, dict]:
    """Benchmark B as one result per workload ("B-llama8b-1024-128", ...), each with the fields
    every GPU result holds (benchmark, device, versions, model, workload, throughputs, peers
    measured in the same call, roofline, copy bandwidth) and that workload's details."""
    out = {}
    common = {k: v for k, v in result.items() if not isinstance(v, dict)}
    for key, part in result.items():
        if not (isinstance(part, dict) and key.startswith("in")):
            continue
        n_in, n_out = (int(x) for x in key[2:].split("_out"))
        peers = {
            "hf_generate_batch": part.get("hf_continuous_batching", {}).get("output_tokens_per_s"),
            "hf_generate": part.get("hf_static_generate", {}).get("output_tokens_per_s"),
        }
        name = f"{result.get('benchmark', 'B-llama8b')}-{n_in}-{n_out}"
        out[name] = {
            **common,
            "benchmark": name,
            "workload": {"model": f"{result.get('model', 'llama-3.1-8b')} shape, random "
                         "weights, bf16",
                         "num_prompts": part["num_prompts"], "input_len": n_in,
                         "output_len": n_out, "ignore_eos": True},
            "output_tokens_per_s": part["output_tokens_per_s"],
            "total_tokens_per_s": part["total_tokens_per_s"],
            "peers": peers,
            "peers_num_prompts": part.get("hf_continuous_batching", {}).get("num_prompts"),
            "roofline_output_tokens_per_s": part["roofline_output_tokens_per_s"],
            "roofline_fraction": part["roofline_fraction"],
            **{f"ratio_vs_{k}": part["output_tokens_per_s"] / v for k, v in peers.items() if v},
            "details": part,
        }  # fmt: skip
    return out


def structured_model(tok_dir: str) -> str:
    """The Qwen3-0.6B shape with the vocabulary of the tokenizer we have (SmolLM2's, 49,152):
    xgrammar treats the ids a model has beyond its tokenizer's as special tokens, and with
    Qwen3's 151,936 ids over a 49k tokenizer its accept and fill cost many times more per
    token - an artifact no real checkpoint has."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(tok_dir)
    eos = tok.eos_token_id
    overrides = {"vocab_size": len(tok), "bos_token_id": eos, "eos_token_id": eos}
    return make_hf_model("qwen3-0.6b", torch.bfloat16, f"/tmp/qwen3_v{len(tok)}_bfloat16",
                         overrides=overrides)


def extras(args: argparse.Namespace) -> dict:
    result: dict = {"device": torch.cuda.get_device_name(0)}
    if args.only_structured:
        tok_dir = os.environ["PAGEDLLM_TOKENIZER_DIR"]
        path = structured_model(tok_dir)
        # the grammars in the worker process (the default on GPUs), then in the engine loop
        for process in (True, False):
            tag = "" if process else "_in_loop"
            result["structured" + tag] = _structured_overhead(path, tok_dir, process=process)
            # 1,024-token prompts: the device, not the host, bounds each step
            result["structured_long_prompts" + tag] = _structured_overhead(
                path, tok_dir, prompt_len=1024, process=process)
        return result
    path = make_hf_model("qwen3-0.6b", torch.bfloat16, "/tmp/qwen3_bfloat16")
    rng = np.random.default_rng(1)
    # (1) prefix caching at a 0% hit rate: distinct random prompts, caching on vs off
    prompts = [rng.integers(100, 150000, size=512).tolist() for _ in range(256)]
    sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    # a discarded first engine compiles the kernels for these shapes; then alternate
    for i, caching in enumerate((True, False, True, False, True, False, True)):
        llm = LLM(path, dtype="bfloat16", max_model_len=2048, enable_prefix_caching=caching,
                  gpu_memory_utilization=0.85)
        llm.generate([{"prompt_token_ids": prompts[0][:8]}], sp, use_tqdm=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        torch.cuda.synchronize()
        key = f"zero_hit_caching_{'on' if caching else 'off'}_tok_s"
        if i > 0:
            result.setdefault(key, []).append(256 * 128 / (time.perf_counter() - t))
        del llm
        free_mem()
    on, off = (np.median(result[f"zero_hit_caching_{k}_tok_s"]) for k in ("on", "off"))
    result["zero_hit_overhead_fraction"] = 1 - on / off
    # (2) shared prefix (341 tokens) + distinct suffixes: throughput caching on vs off
    prefix = rng.integers(100, 150000, size=341).tolist()
    shared = [prefix + rng.integers(100, 150000, size=32).tolist() for _ in range(256)]
    for caching in (False, True):
        llm = LLM(path, dtype="bfloat16", max_model_len=2048, enable_prefix_caching=caching,
                  gpu_memory_utilization=0.85)
        llm.generate([{"prompt_token_ids": shared[0][:8]}], sp, use_tqdm=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in shared],
                            SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                            use_tqdm=False)
        torch.cuda.synchronize()
        el = time.perf_counter() - t
        result[f"shared_prefix_caching_{'on' if caching else 'off'}"] = {
            "output_tok_s": 256 * 64 / el, "cached_tokens": sum(o.num_cached_tokens
                                                                for o in outs)}
        del llm
        free_mem()
    result["shared_prefix_speedup"] = (result["shared_prefix_caching_on"]["output_tok_s"]
                                       / result["shared_prefix_caching_off"]["output_tok_s"])
    # (3) structured outputs: every request constrained by a JSON schema vs none
    tok_dir = os.environ.get("PAGEDLLM_TOKENIZER_DIR")
    if tok_dir:
        try:
            result["structured"] = _structured_overhead(structured_model(tok_dir), tok_dir)
        except Exception as e:
            result["structured"] = {"error": repr(e)[:500]}
    return result


def _structured_overhead(path: str, tok_dir: str, prompt_len: int = 64,
                         process: bool = True) -> dict:
    """A JSON-schema-constrained batch vs the same batch unconstrained, doing equal work: the
    free run gets each request's constrained output length as max_tokens (a grammar that ends
    a request early must not make the comparison about batch size). ``process``: the
    grammars in the worker process, else in the engine loop."""
    from pagedllm.structured_output.params import StructuredOutputsParams

    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age", "tags"]}
    prompts = [{"prompt_token_ids": [1000 + (i + j) % 40000 for j in range(prompt_len)]}
               for i in range(128)]
    out: dict = {"schema": schema, "model": f"qwen3-0.6b shape, bf16, vocabulary of {tok_dir}",
                 "num_requests": len(prompts), "prompt_len": prompt_len, "max_tokens": 256,
                 "grammar_process": process}
    llm = LLM(path, tokenizer=tok_dir, dtype="bfloat16", max_model_len=prompt_len + 512,
              gpu_memory_utilization=0.85, grammar_process=process)
    so = StructuredOutputsParams(json=schema)
    # no per-request seeds: a seeded row draws its noise from its own generator (one small
    # kernel per row), a cost both runs would share that would shrink the measured overhead
    constrained = [SamplingParams(temperature=1.0, max_tokens=256, ignore_eos=True,
                                  structured_outputs=so) for _ in range(len(prompts))]
    # warm-up at the full batch, both ways, so no kernel compiles inside a timed run
    warm = llm.generate(prompts, constrained, use_tqdm=False)
    llm.generate(prompts, [SamplingParams(temperature=1.0, max_tokens=len(o.outputs[0].token_ids),
                                          ignore_eos=True) for o in warm], use_tqdm=False)
    # the free batch does the constrained run's work: each request's constrained length
    lengths = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, constrained,
                                                                 use_tqdm=False)]
    free = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in lengths]

    def timed(params: list, llm: LLM = llm) -> tuple[float, float]:
        """(output tok/s, the engine thread's CPU ms per step) of one run."""
        torch.cuda.synchronize()
        t, cpu = time.perf_counter(), time.thread_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        el, cpu = time.perf_counter() - t, time.thread_time() - cpu
        n = [len(o.outputs[0].token_ids) for o in outs]
        return sum(n) / el, cpu / max(n) * 1e3

    # Pairs of runs back to back, in alternating order: this host's noise (free runs of one
    # engine have spread 27k-45k tok/s) moves both runs of a pair alike, so the overhead is
    # the median over pairs of 1 - constrained / free. The engine thread's CPU time per step
    # is the host-bound regime's cost, free of the wall clock's noise.
    ratios, cpu_c, cpu_f = [], [], []
    for i in range(8):
        order = ("c", "f") if i % 2 == 0 else ("f", "c")
        res = {k: timed(constrained if k == "c" else free) for k in order}
        out.setdefault("constrained", []).append(res["c"][0])
        out.setdefault("free", []).append(res["f"][0])
        ratios.append(res["c"][0] / res["f"][0])
        cpu_c.append(res["c"][1])
        cpu_f.append(res["f"][1])
    out["mean_output_len"] = float(np.mean(lengths))
    c, f = np.median(out["constrained"]), np.median(out["free"])
    out["overhead_fraction"] = 1 - c / f
    out["overhead_fraction_paired"] = 1 - float(np.median(ratios))
    # the host's noise only ever slows a run down: the best runs compare the two as well
    out["overhead_fraction_best"] = 1 - max(out["constrained"]) / max(out["free"])
    out["engine_thread_cpu_ms_per_step"] = {"constrained": float(np.median(cpu_c)),
                                            "free": float(np.median(cpu_f))}
    out["engine_thread_cpu_overhead_fraction"] = float(np.median(cpu_c) / np.median(cpu_f) - 1)
    del llm
    free_mem()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("part", choices=["check", "bench-a", "bench-b", "extras"])
    p.add_argument("--num-b", type=int, default=1000)
    p.add_argument("--peer-b", type=int, default=64)
    p.add_argument("--warm-b", type=int, default=300, help="warm-up requests per B workload")
    p.add_argument("--warm-out", type=int, default=0,
                   help="bench-b: output tokens of each warm-up request (0: the workload's)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--peer-prompts", type=int, default=0)
    p.add_argument("--skip-peers", action="store_true")
    p.add_argument("--eager-too", action="store_true")
    p.add_argument("--b-shapes", default="", help="bench-b: e.g. 128x1024 (default both)")
    p.add_argument("--b-model", default="llama-3.1-8b",
                   help="bench-b: a built-in shape (e.g. qwen3-30b-a3b, a mixture of experts)")
    p.add_argument("--sync-too", action="store_true", help="also without async scheduling")
    p.add_argument("--time-device", action="store_true", help="CUDA events around each step")
    p.add_argument("--only-structured", action="store_true")
    p.add_argument("--profile", action="store_true", help="bench-a: device time by kernel kind")
    args = p.parse_args()
    fn = {"check": check, "bench-a": bench_a, "bench-b": bench_b, "extras": extras}[args.part]
    result = fn(args)
    os.makedirs(args.out, exist_ok=True)
    part = args.part + ("_structured" if args.only_structured else "")
    files = {part: result}
    if args.part == "bench-b":  # one file per workload: gpu_bench-b-1024-128_<device>.json
        label = _b_label(args.b_model)  # (another shape: gpu_bench-b-<shape>-1024-128_...)
        tag = "" if label == "B-llama8b" else f"-{args.b_model}"
        files = {f"bench-b{tag}-{k[len(label) + 1 :]}": v for k, v in split_b(result).items()}
    for name, res in files.items():
        path = os.path.join(args.out, f"gpu_{name}_{device_tag()}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=2)
        print(json.dumps(res, indent=2))
        print("wrote", path)


if __name__ == "__main__":
    main()

"""Speculative decoding with a draft model on the GPU: output tok/s against the
acceptance rate, at several batch sizes and k, against the same engine without speculation
on the same workload in the same process.

Prefix caching is off (the timed prompts repeat across draft settings).

- ``qwen3``: the Qwen3-0.6B shape (bf16, random weights saved once, so target and draft load
  the same ones). The draft model is first the target's own weights (every greedy draft is
  the target's token: acceptance 1, the upper bound and the machinery's overhead), then the
  same weights with relative Gaussian noise added in place (each draft weight w + s * std(w)
  * N(0, 1)) to sweep the acceptance rate down towards 0. Batches 1, 16, 64, 256 (one prompt
  of 128 random tokens per request, 192 output tokens, greedy, ignore_eos); k = 2 and 4.
  At batch 256 also ``disable_by_batch_size`` 64: speculation paused under load.
- ``llama8b``: the Llama-3.1-8B shape with a Llama-3.2-1B-shaped draft (same vocabulary;
  dummy weights: unrelated, so drafts are rarely accepted - what a useless draft costs), and
  n-gram on the same workload.
- ``cheap``: the ``qwen3`` workload with cheap proposers: n-gram (on the host, and on the
  device: ngram_gpu, whose speculating steps stay asynchronous), suffix, and drafts made of
  the target's first 2 or 7 of its 28 layers (``first_layers_copy``); n-gram and suffix also
  with ``disable_when_slower`` (``*_paced``).
- ``paced``: speculation where it pays against drift between runs: the engine without
  speculation and n-gram / suffix with and without ``disable_when_slower`` live side by side
  (each its own KV cache of ``--kv-gib``), each warmed up on a batch, then ``--repeats``
  rounds of one timed run per engine in a rotating order; each engine's ratio to the engine
  without speculation over all rounds and per round, and each paced engine's levels
  (``SpecPacer.summary``: ms a step in each mode, steps scheduled in each) and speculation
  counters, both as they stand after the batch (cumulative over the batches before it).
  ``--trace`` adds each timed run's garbage collections over 1 ms, the proposer's time for
  ending requests and the pacer's steps in each mode with their medians; ``--trace-steps``
  every step (load, mode, its time or None where not timed, prompt tokens) and phase.

Greedy bf16: speculation verifies k + 1 positions in one pass (other kernels than a decode
step's), so a near tie may break differently; the agreement with the run without speculation
is recorded, not asserted (the fp32 equality tests are tests/models/test_spec_decode.py).

    python benchmarks/spec_decode_gpu.py qwen3 --out $OUT
    python benchmarks/spec_decode_gpu.py llama8b --out $OUT
    python benchmarks/spec_decode_gpu.py cheap --out $OUT
    python benchmarks/spec_decode_gpu.py paced --repeats 3 --out $OUT
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_suite import CONFIGS, device_tag, make_hf_model, provenance  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402

PROMPT_LEN, OUTPUT_LEN = 128, 192
BATCHES = (1, 16, 64, 256)
NOISE = (0.0, 0.05, 0.15, 0.4, 1.0)  # relative weight noise of the draft


def _trace_summary(trace: list[tuple], keep_steps: bool) -> dict:
    """A timed run's pacer trace (``SpecPacer.trace``): its steps scheduled speculating and
    plain, the medians of the timed ones (ms), and with ``keep_steps`` every step and phase
    (~1 MB a config at 10 rounds of 4 batches)."""
    steps = [s for s in trace if s[0] != "phase"]
    out: dict = {}
    for mode, name in ((True, "on"), (False, "off")):
        timed = [s[2] for s in steps if s[1] is mode and s[2] is not None]
        out[f"steps_{name}"] = sum(1 for s in steps if s[1] is mode)
        out[f"{name}_step_ms_median"] = round(1e3 * float(np.median(timed)), 3) if timed else None
    if keep_steps:
        out["steps"] = [list(x) for x in trace]
    return out


def _workload(batch: int, vocab: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(100, vocab - 100, PROMPT_LEN).tolist()}
            for _ in range(batch)]  # fmt: skip


def _metrics(llm: LLM) -> dict:
    return {m.name: getattr(m, "value", None) for m in llm.get_metrics()}


REPEATS = 1  # timed runs per batch (--repeats), each on its own prompts


def _generate_timed(llm: LLM, prompts: list, sp: SamplingParams) -> tuple[list, float]:
    """The outputs of one generate call and its seconds, the device drained on both sides."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    torch.cuda.synchronize()
    return outs, time.perf_counter() - t


def _timed(llm: LLM, batch: int, vocab: int, warm: bool = True) -> dict:
    """Warm-up on other prompts of the same shape (unless the engine ran this shape
    already), then the timed runs (``REPEATS``, each on other prompts: suffix decoding
    learns from earlier responses); their tokens and seconds summed."""
    sp = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    if warm:
        llm.generate(_workload(batch, vocab, seed=1000 + batch), sp, use_tqdm=False)
    before = _metrics(llm)
    el, outs, runs_s = 0.0, [], []
    for i in range(REPEATS):
        prompts = _workload(batch, vocab, seed=batch + 100_000 * i)
        run_outs, run_s = _generate_timed(llm, prompts, sp)
        outs += run_outs
        runs_s.append(run_s)
        el += run_s
    after = _metrics(llm)
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {"batch": batch, "elapsed_s": el, "output_tokens": produced,
           "output_tokens_per_s": produced / el, "runs_s": runs_s,
           "tokens": [list(o.outputs[0].token_ids) for o in outs]}  # fmt: skip
    name = "vllm:spec_decode_num_draft_tokens"
    if name in after:
        drafted = after[name] - before.get(name, 0)
        accepted = after["vllm:spec_decode_num_accepted_tokens"] - before.get(
            "vllm:spec_decode_num_accepted_tokens", 0
        )
        drafts = after["vllm:spec_decode_num_drafts"] - before.get("vllm:spec_decode_num_drafts", 0)
        row.update(draft_tokens=drafted, accepted_tokens=accepted, drafts=drafts,
                   acceptance_rate=accepted / drafted if drafted else None,
                   mean_acceptance_length=1 + accepted / drafts if drafts else None)  # fmt: skip
    return row


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(int(x == y) for p, q in zip(a, b) for x, y in zip(p, q))
    return same / max(1, sum(len(p) for p in a))


def _perturb(llm: LLM, noise: float, seed: int) -> None:
    """The draft's weights := the target's + noise * std(w) * N(0, 1), in place."""
    runner = llm.llm_engine.engine_core.model_runner
    target = dict(runner.model.named_parameters())
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in runner.drafter.model.named_parameters():
            w = target[name]
            p.copy_(w)
            if noise > 0 and "norm" not in name:
                scale = noise * w.float().std()
                p.add_((scale * torch.randn(w.shape, generator=gen, device="cuda")).to(p.dtype))


def _save(args: argparse.Namespace, result: dict) -> None:
    """Write what has been measured so far (a time limit may cut the run short)."""
    os.makedirs(args.out, exist_ok=True)
    tag = f"_{args.tag}" if args.tag else ""
    path = os.path.join(args.out, f"spec_decode_{args.part}{tag}_{device_tag()}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def _free(llm: LLM) -> None:
    """Drop an engine and its KV cache (the next one sizes its own)."""
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _qwen3_baseline(args: argparse.Namespace, benchmark: str) -> tuple:
    """The Qwen3-0.6B workload (random weights saved once, bf16) and its run without
    speculation: (path, vocab, batches, engine kwargs, result dict, baseline rows by batch)."""
    path = make_hf_model("qwen3-0.6b", torch.bfloat16, "/tmp/qwen3_bfloat16")
    vocab = 151936
    batches = [b for b in BATCHES if b <= args.max_batch]
    common = dict(dtype="bfloat16", max_model_len=1024, max_num_seqs=max(batches),
                  gpu_memory_utilization=0.8, enable_prefix_caching=False)  # fmt: skip
    workload = {"model": "qwen3-0.6b shape, random weights, bf16", "prompt_len": PROMPT_LEN,
                "output_len": OUTPUT_LEN, "greedy": True, "ignore_eos": True,
                "batches": batches, "timed_runs_per_batch": REPEATS}  # fmt: skip
    result: dict = {**provenance(benchmark), "workload": workload}
    llm = LLM(path, **common)
    base = {b: _timed(llm, b, vocab) for b in batches}
    _free(llm)
    result["baseline"] = {b: {k: v for k, v in r.items() if k != "tokens"} for b, r in base.items()}
    print(json.dumps(result["baseline"]), flush=True)
    return path, vocab, batches, common, result, base


def qwen3(args: argparse.Namespace) -> dict:
    path, vocab, batches, common, result, base = _qwen3_baseline(args, "spec-decode-draft-model")
    rows: list[dict] = []
    result["draft_model"] = rows
    for k in args.k:
        spec = {"method": "draft_model", "model": path, "num_speculative_tokens": k}
        llm = LLM(path, speculative_config=spec, **common)
        for noise in NOISE:
            _perturb(llm, noise, seed=k)
            for b in batches:
                r = _timed(llm, b, vocab, warm=noise == NOISE[0])
                speedup = r["output_tokens_per_s"] / base[b]["output_tokens_per_s"]
                agree = _agreement(base[b]["tokens"], r.pop("tokens"))
                r.update(k=k, noise=noise, speedup=speedup, token_agreement=agree)
                rows.append(r)
                print(json.dumps(r), flush=True)
                _save(args, result)
        _free(llm)
    if 256 in batches:  # paused under load: the engine does not speculate at >= 64 running
        spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 4,
                "disable_by_batch_size": 64}  # fmt: skip
        llm = LLM(path, speculative_config=spec, **common)
        r = _timed(llm, 256, vocab)
        r.update(k=4, noise=0.0, disable_by_batch_size=64,
                 speedup=r["output_tokens_per_s"] / base[256]["output_tokens_per_s"],
                 token_agreement=_agreement(base[256]["tokens"], r.pop("tokens")))  # fmt: skip
        rows.append(r)
        print(json.dumps(r), flush=True)
        _free(llm)
    result["draft_model"] = rows
    return result


def _run_proposers(args: argparse.Namespace, target: str, proposers: dict, common: dict,
                   vocab: int, batches: list[int], base: dict, result: dict,
                   rows: list[dict]) -> None:  # fmt: skip
    """One engine per proposer (name -> speculative_config), every batch against ``base``;
    each row appended to ``rows`` (a list in ``result``) and the result saved after it."""
    for name, spec in proposers.items():
        llm = LLM(target, speculative_config=spec, **common)
        for b in batches:
            r = _timed(llm, b, vocab)
            r.update(proposer=name, k=spec["num_speculative_tokens"],
                     speedup=r["output_tokens_per_s"] / base[b]["output_tokens_per_s"],
                     token_agreement=_agreement(base[b]["tokens"], r.pop("tokens")))  # fmt: skip
            rows.append(r)
            print(json.dumps(r), flush=True)
            _save(args, result)
        _free(llm)


def first_layers_copy(path: str, out: str, layers: int) -> str:
    """A draft made of the target's first ``layers`` decoder layers (its embedding, final
    norm and LM head kept): a cheap draft with the target's vocabulary whose greedy tokens
    often agree with the target's (layer skipping, as in self-speculative decoding)."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    if os.path.exists(os.path.join(out, "config.json")):
        return out
    os.makedirs(out, exist_ok=True)
    tensors = {}
    for name in sorted(os.listdir(path)):
        src = os.path.join(path, name)
        if name.endswith(".safetensors"):
            with safe_open(src, "pt") as f:
                for key in f.keys():
                    parts = key.split(".")
                    if parts[:2] == ["model", "layers"] and int(parts[2]) >= layers:
                        continue
                    tensors[key] = f.get_tensor(key)
        elif name == "config.json":
            with open(src) as f:
                cfg = json.load(f)
            cfg["num_hidden_layers"] = layers
            if isinstance(cfg.get("layer_types"), list):
                cfg["layer_types"] = cfg["layer_types"][:layers]
            with open(os.path.join(out, name), "w") as f:
                json.dump(cfg, f)
        elif not name.endswith(".index.json") and os.path.isfile(src):
            shutil.copy(src, out)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def cheap(args: argparse.Namespace) -> dict:
    """Cheap proposers on the Qwen3-0.6B shape (the target's saved random weights, bf16):
    n-gram and suffix (no model: drafting is host work) and drafts made of the target's
    first 2 or 7 of 28 layers (a pass costs a fraction of the target's; their acceptance is
    whatever these weights give). Same workload and baseline as ``qwen3``."""
    path, vocab, batches, common, result, base = _qwen3_baseline(
        args, "spec-decode-cheap-proposers"
    )
    k = 4
    proposers = {
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3},
        # the same lookup on the device: speculating steps stay asynchronous
        "ngram_gpu": {"method": "ngram_gpu", "num_speculative_tokens": k, "prompt_lookup_max": 3},
        "suffix": {"method": "suffix", "num_speculative_tokens": k},
    }
    # the same, speculating only at the loads where the engine measured it faster
    for name in ("ngram", "ngram_gpu", "suffix"):
        proposers[f"{name}_paced"] = {**proposers[name], "disable_when_slower": True}
    for layers in (2, 7):
        if args.proposers and f"first{layers}_of_28" not in args.proposers.split(","):
            continue
        draft = first_layers_copy(path, f"/tmp/qwen3_first{layers}", layers)
        proposers[f"first{layers}_of_28"] = {"method": "draft_model", "model": draft,
                                              "num_speculative_tokens": k}  # fmt: skip
    if args.proposers:
        proposers = {n: proposers[n] for n in args.proposers.split(",")}
    rows: list[dict] = []
    result["proposers"] = rows
    _run_proposers(args, path, proposers, common, vocab, batches, base, result, rows)
    return result


def paced(args: argparse.Namespace) -> dict:
    """Engines side by side, timed runs interleaved (see the module's docstring)."""
    path = make_hf_model("qwen3-0.6b", torch.bfloat16, "/tmp/qwen3_bfloat16")
    vocab, k = 151936, 4
    batches = [b for b in BATCHES if b <= args.max_batch]
    if args.batches:
        batches = [int(x) for x in args.batches.split(",")]
    common = dict(dtype="bfloat16", max_model_len=1024, max_num_seqs=max(batches),
                  kv_cache_memory_bytes=int(args.kv_gib * 2**30),
                  enable_prefix_caching=False)  # fmt: skip
    configs: dict[str, dict | None] = {"off": None}
    for name in (args.proposers or "ngram,ngram_paced,suffix,suffix_paced").split(","):
        method = name.removesuffix("_paced")
        spec = {"method": method, "num_speculative_tokens": k}
        if method in ("ngram", "ngram_gpu"):
            spec["prompt_lookup_max"] = 3
        if name.endswith("_paced"):
            spec["disable_when_slower"] = True
        configs[name] = spec
    result: dict = {**provenance("spec-decode-paced"),
                    "workload": {"model": "qwen3-0.6b shape, random weights, bf16",
                                 "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN,
                                 "greedy": True, "ignore_eos": True, "batches": batches,
                                 "rounds": REPEATS, "configs": configs},
                    "batches": {}}  # fmt: skip
    engines = {n: LLM(path, speculative_config=c, **common) for n, c in configs.items()}
    sp = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    names = list(engines)
    # --trace: each timed run's garbage collections (generation, ms), the pacer's steps
    gcs: list[list] = []
    gc_start: list[float] = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gcs.append([info["generation"], 1e3 * (time.perf_counter() - gc_start[0])])

    if args.trace:
        gc.callbacks.append(on_gc)
    for b in batches:
        for llm in engines.values():
            llm.generate(_workload(b, vocab, seed=1000 + b), sp, use_tqdm=False)
        runs: dict[str, list[float]] = {n: [] for n in names}
        traces: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(REPEATS):
            prompts = _workload(b, vocab, seed=b + 100_000 * r)
            order = names[r % len(names) :] + names[: r % len(names)]
            for n in order:
                spec = engines[n].llm_engine.engine_core.scheduler.spec
                pacer = spec.pacer if spec is not None else None
                if args.trace and pacer is not None:
                    pacer.trace, finish0 = [], pacer.not_timed_total_s
                gcs.clear()
                outs, el = _generate_timed(engines[n], prompts, sp)
                runs[n].append(sum(len(o.outputs[0].token_ids) for o in outs) / el)
                if args.trace:
                    t = {"s": el, "gc_ms": [[g, round(ms, 2)] for g, ms in gcs if ms > 1]}
                    if pacer is not None:
                        t["finish_s"] = pacer.not_timed_total_s - finish0
                        t.update(_trace_summary(pacer.trace, args.trace_steps))
                        pacer.trace = None
                    traces[n].append(t)
        row: dict = {}
        for n in names:
            ratios = [x / y for x, y in zip(runs[n], runs["off"])]
            # the spread of the round ratios: their median and a bootstrap 90% interval of
            # their mean (the host's noise moves single rounds by up to +-20% at 256)
            rng = np.random.default_rng(0)
            boot = rng.choice(ratios, (2000, len(ratios))).mean(axis=1)
            row[n] = {"output_tokens_per_s": runs[n], "round_ratios": ratios,
                      "ratio": float(np.mean(runs[n]) / np.mean(runs["off"])),
                      "ratio_median": float(np.median(ratios)),
                      "round_ratio_mean_90ci": [float(np.quantile(boot, 0.05)),
                                                float(np.quantile(boot, 0.95))]}  # fmt: skip
            if args.trace:
                row[n]["rounds"] = traces[n]
            spec = engines[n].llm_engine.engine_core.scheduler.spec
            if spec is not None:
                row[n]["spec_stats"] = spec.stats()
                if spec.pacer is not None:
                    row[n]["pacer"] = spec.pacer.summary()
        result["batches"][b] = row
        print(json.dumps({"batch": b, **{n: round(v["ratio"], 3) for n, v in row.items()}}),
              flush=True)  # fmt: skip
        _save(args, result)
    return result


def llama8b(args: argparse.Namespace) -> dict:
    target = os.path.join(CONFIGS, "llama-3.1-8b")
    draft = os.path.join(CONFIGS, "llama-3.2-1b")
    vocab = 128256
    batches = [b for b in (1, 16, 64) if b <= args.max_batch]
    common = dict(dtype="bfloat16", load_format="dummy", max_model_len=1024,
                  max_num_seqs=max(batches), gpu_memory_utilization=0.85,
                  enable_prefix_caching=False)  # fmt: skip
    result: dict = {**provenance("spec-decode-draft-model-8b"),
                    "workload": {"model": "llama-3.1-8b shape, dummy weights, bf16",
                                 "draft": "llama-3.2-1b shape, dummy weights (unrelated)",
                                 "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN,
                                 "batches": batches}}  # fmt: skip
    llm = LLM(target, **common)
    base = {b: _timed(llm, b, vocab) for b in batches}
    _free(llm)
    result["baseline"] = {b: {k: v for k, v in r.items() if k != "tokens"} for b, r in base.items()}
    rows: list[dict] = []
    result["draft_model"] = rows
    proposers = {"llama-3.2-1b": {"method": "draft_model", "model": draft,
                                  "num_speculative_tokens": 4},
                 "ngram": {"method": "ngram", "num_speculative_tokens": 4,
                           "prompt_lookup_max": 3}}  # fmt: skip
    _run_proposers(args, target, proposers, common, vocab, batches, base, result, rows)
    return result


def profile(args: argparse.Namespace) -> dict:
    """Where a speculative step's time goes at batch 1 (Qwen3-0.6B shape, dummy weights, the
    draft the same shape): wall time per generate and per engine step with and without
    speculation (no profiler), then a cProfile of the host side of each (top functions by
    own and by cumulative time)."""
    import cProfile
    import io
    import pstats

    shape = os.path.join(CONFIGS, "qwen3-0.6b")
    common = dict(dtype="bfloat16", load_format="dummy", max_model_len=1024, max_num_seqs=8,
                  gpu_memory_utilization=0.5, enable_prefix_caching=False)  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    res: dict = {**provenance("spec-decode-profile")}
    draft = {"method": "draft_model", "model": shape, "num_speculative_tokens": 4}
    configs = [("plain", None, False), ("draft_k4", draft, False), ("draft_k4_eager", draft, True)]
    if args.proposers:  # cheap proposers on the saved random weights (their outputs repeat)
        shape = make_hf_model("qwen3-0.6b", torch.bfloat16, "/tmp/qwen3_bfloat16")
        common.pop("load_format")
        configs = []
        for name in args.proposers.split(","):
            spec = None if name == "plain" else {"method": name, "num_speculative_tokens": 4}
            if name in ("ngram", "ngram_gpu"):
                spec["prompt_lookup_max"] = 3  # type: ignore[index]
            configs.append((name, spec, False))
    for name, spec, eager in configs:
        t = time.perf_counter()
        llm = LLM(shape, speculative_config=spec, enforce_eager=eager, **common)
        res[f"{name}_startup_s"] = time.perf_counter() - t
        core = llm.llm_engine.engine_core
        llm.generate(_workload(1, 151936, 5), sp, use_tqdm=False)
        steps = []
        orig_step = core.step

        def counted(*a, _orig=orig_step, _steps=steps, **kw):  # noqa: ANN002, ANN003, ANN202
            _steps.append(1)
            return _orig(*a, **kw)

        # the time each step waits for the device (the executor's resolve): near 0 where the
        # host bounds the step, most of it where the device does
        waits: list[float] = []
        orig_resolve = core.executor.resolve

        def timed_resolve(step, _orig=orig_resolve, _waits=waits):  # noqa: ANN001, ANN202
            t0 = time.perf_counter()
            out = _orig(step)
            _waits.append(time.perf_counter() - t0)
            return out

        core.step = counted
        core.executor.resolve = timed_resolve
        _, el = _generate_timed(llm, _workload(1, 151936, 6), sp)
        core.step = orig_step
        core.executor.resolve = orig_resolve
        res[f"{name}_resolve_wait_ms_per_step"] = 1e3 * sum(waits) / max(1, len(steps))
        res[f"{name}_async_steps"] = core.num_async_steps
        res[f"{name}_generate_s"] = el
        res[f"{name}_steps"] = len(steps)
        res[f"{name}_ms_per_step"] = 1e3 * el / max(1, len(steps))
        res[f"{name}_output_tokens_per_s"] = 96 / el
        res[f"{name}_metrics"] = {k: v for k, v in _metrics(llm).items() if "spec" in k}
        prof = cProfile.Profile()
        prof.enable()
        llm.generate(_workload(1, 151936, 7), sp, use_tqdm=False)
        prof.disable()
        print(name, json.dumps({k: v for k, v in res.items() if k.startswith(name)}))
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(30)
            text = buf.getvalue()
            res[f"{name}_profile_{key}"] = text[:8000]
            print(text[:5000], flush=True)
        del llm, core, orig_step, counted, orig_resolve  # before the next engine's KV cache
        gc.collect()
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=["qwen3", "cheap", "llama8b", "profile", "paced"])
    ap.add_argument("--kv-gib", type=float, default=12.0, help="paced: each engine's KV cache")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per batch")
    ap.add_argument("--proposers", default="",
                    help="cheap: only these (comma-separated, e.g. suffix,suffix_paced)")
    ap.add_argument("--batches", default="", help="paced: only these batches (e.g. 16,256)")
    ap.add_argument("--trace", action="store_true",
                    help="paced: per timed run, its garbage collections, the proposer's time "
                         "for ending requests and the pacer's steps in each mode")
    ap.add_argument("--trace-steps", action="store_true",
                    help="paced, with --trace: every step and phase of the pacer too")
    ap.add_argument("--tag", default="",
                    help="a name for a run of other proposers: spec_decode_PART_TAG_<device>.json")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    global REPEATS
    REPEATS = args.repeats
    parts = {"qwen3": qwen3, "cheap": cheap, "llama8b": llama8b, "profile": profile,
             "paced": paced}  # fmt: skip
    result = parts[args.part](args)
    _save(args, result)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
